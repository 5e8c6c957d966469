#!/usr/bin/env python3
"""A small, self-contained GRPO loop in plain PyTorch, with a real FP8 precision switch.

A tiny decoder-only transformer is trained from scratch on a verifiable toy task (add two
numbers; reward 1 for the exact sum followed by EOS, else 0): a short supervised warm start in
FP32 that depends on ``--init-seed`` only (the shared "checkpoint" every seed and precision starts
from), then GRPO steps in the chosen precision, whose randomness ``--seed`` drives.

Each GRPO step:
  * rollout: a separate copy of the policy (the "inference engine") holding weights exported
    from the trainer (BF16 for bf16/fp8, run without autocast) samples G completions per prompt,
    token by token with a KV cache under ``torch.no_grad``, recording each token's log-probability;
  * train: the trainer (FP32 master weights, autocast) recomputes the same log-probabilities in a
    full-sequence forward, so the train-vs-rollout mismatch is measured as real frameworks do
    (mean |logp_train - logp_rollout|, a k3 KL estimate, importance-ratio range);
  * group-normalised advantages, clipped policy-gradient loss over ``--minibatches`` updates (the
    second one is off-policy, so clipping is real), truncated importance sampling against the
    rollout's log-probs (as TRL's ``vllm_importance_sampling_correction``), optional k3 KL to the
    frozen warm-start reference, AdamW, gradient clipping.

Precisions (``--precision``):
  fp32  everything in FP32 (TF32 off).
  bf16  the whole forward under ``torch.autocast(dtype=torch.bfloat16)``; FP32 master weights.
  fp8   as bf16, and in addition the transformer blocks' linear layers (attention QKV and output
        projections, MLP fc1 and fc2) run their forward GEMM in FP8 E4M3 on the tensor cores via
        ``torch._scaled_mm`` with rowwise scaling: one FP32 scale per activation row (token) and
        one per weight output channel, BF16 output. The backward GEMMs (dgrad, wgrad) run in BF16
        on the BF16 copies of the high-precision operands saved by the forward. The token
        embedding, position embedding, norms, attention softmax and the LM head stay in BF16
        autocast. It needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9; Hopper
        for the rowwise kernel) and fails loudly anywhere else -- there is no fallback.

Metrics go to one TensorBoard event file in ``--out`` with TRL GRPOTrainer's names under
TensorBoard (``train/reward``, ``train/kl``, ``train/grad_norm``, ...; 1-based steps), so a
lockstep suite reads them with ``preset = "trl"``. Extra keys: ``train/sampling/train_rollout_kl_k3``
and per-layer ``train/grad_norm/layer_{i}/{site}`` (mapped explicitly in the suite).

No downloads, no dataset: everything is generated from ``--seed``.
"""

import argparse
import json
import math
import os
import sys
import time

# Deterministic cuBLAS (must be set before CUDA initialises).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ---------------------------------------------------------------------------------------------
# The task: "AA+BB=" -> digits of the sum, then EOS.

PLUS, EQ, EOS, PAD = 10, 11, 12, 13
VOCAB = 14


def encode_prompts(a, b, digits):
    """a, b: int64 tensors (N,). Returns (N, 2*digits+2) prompt tokens, zero-padded numbers."""
    cols = []
    for x in (a, b):
        for i in reversed(range(digits)):
            cols.append((x // 10**i) % 10)
        cols.append(torch.full_like(x, PLUS if x is a else EQ))
    return torch.stack(cols, dim=1)


def answer_tokens(s, resp_len):
    """Sum s (N,) -> (N, resp_len) target tokens: digits without leading zeros, EOS, then PAD."""
    out = torch.full((s.shape[0], resp_len), PAD, dtype=torch.long)
    for n, v in enumerate(s.tolist()):
        toks = [int(c) for c in str(v)] + [EOS]
        out[n, : len(toks)] = torch.tensor(toks)
    return out


def score(resp, s):
    """Exact match: the sum's digits then EOS. resp (N, R) sampled tokens. Returns reward (N,)
    and completion length (tokens up to and including the first EOS, else R)."""
    target = answer_tokens(s.cpu(), resp.shape[1])
    resp = resp.cpu()
    is_eos = resp == EOS
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.float().argmax(dim=1), torch.full_like(s.cpu(), resp.shape[1]))
    length = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, resp.shape[1]))
    pos = torch.arange(resp.shape[1]).unsqueeze(0)
    upto = pos < length.unsqueeze(1)
    match = ((resp == target) | ~upto).all(dim=1) & has_eos
    return match.float(), length


# ---------------------------------------------------------------------------------------------
# FP8 rowwise linear (forward on the tensor cores through torch._scaled_mm).

E4M3_MAX = 448.0


def quantize_rowwise(t):
    """t (R, K) -> (E4M3 codes (R, K), FP32 dequantization scales (R, 1)): scale = amax/448."""
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def fp8_rowwise_mm(x, w):
    """x (M, K) BF16, w (N, K) BF16 -> x @ w.T (M, N) BF16, computed as E4M3 x E4M3 on the tensor
    cores with FP32 rowwise scales (scale_a (M, 1), scale_b (1, N)); mat2 is column-major."""
    m = x.shape[0]
    pad = (-m) % 16  # keep M a multiple of 16 for the FP8 kernels
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    xq, xs = quantize_rowwise(x)
    wq, ws = quantize_rowwise(w)
    out = torch._scaled_mm(
        xq,
        wq.t(),  # (K, N), column-major view of the row-major (N, K) codes
        scale_a=xs,  # (M, 1) float32
        scale_b=ws.reshape(1, -1).contiguous(),  # (1, N) float32
        out_dtype=torch.bfloat16,
    )
    return out[:m] if pad else out


class _Fp8LinearFn(torch.autograd.Function):
    """Forward: FP8 E4M3 rowwise GEMM. Backward: BF16 GEMMs on the BF16 copies of x and W (the
    high-precision operands), FP32 accumulation, weight gradient returned in FP32."""

    @staticmethod
    def forward(ctx, x, w):
        with torch.autocast(device_type="cuda", enabled=False):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            wb = w.to(torch.bfloat16)
            y = fp8_rowwise_mm(x2, wb)
        ctx.save_for_backward(x2, wb)
        ctx.x_dtype = x.dtype
        ctx.w_dtype = w.dtype
        return y.reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, wb = ctx.saved_tensors
        with torch.autocast(device_type="cuda", enabled=False):
            g = gy.reshape(-1, gy.shape[-1]).to(torch.bfloat16)
            gx = (g @ wb).to(ctx.x_dtype)
            gw = (g.t() @ x2).to(ctx.w_dtype)
        return gx.reshape(*gy.shape[:-1], wb.shape[1]), gw


class Linear(nn.Module):
    """A bias-free linear layer, initialised as ``nn.Linear``. With ``fp8 = True`` its forward GEMM
    runs in FP8 (``_Fp8LinearFn``); otherwise it is ``F.linear`` (under autocast when enabled).
    One class for every precision, so the parameters and their initialisation are identical."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.fp8 = False

    def forward(self, x):
        if self.fp8:
            return _Fp8LinearFn.apply(x, self.weight)
        return F.linear(x, self.weight)


def require_fp8(device):
    """Fail loudly unless the FP8 tensor-core path can run here."""
    if device.type != "cuda":
        sys.exit(f"--precision fp8 needs a CUDA GPU with FP8 tensor cores; device is {device} (no fallback)")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        sys.exit(
            f"--precision fp8 needs compute capability >= 8.9 (Ada/Hopper); "
            f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]} (no fallback)"
        )
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        sys.exit(f"--precision fp8: torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn")


# ---------------------------------------------------------------------------------------------
# The model: pre-norm decoder-only transformer; Megatron-style module names.


class Attention(nn.Module):
    def __init__(self, d, heads, lin):
        super().__init__()
        self.heads = heads
        self.linear_qkv = lin(d, 3 * d)
        self.linear_proj = lin(d, d)

    def forward(self, x, cache=None):
        b, t, d = x.shape
        qkv = self.linear_qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        causal = True
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
                causal = t > 1
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.linear_proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d, ff, lin):
        super().__init__()
        self.linear_fc1 = lin(d, ff)
        self.linear_fc2 = lin(ff, d)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads, ff, lin):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attention = Attention(d, heads, lin)
        self.pre_mlp_layernorm = nn.LayerNorm(d)
        self.mlp = Mlp(d, ff, lin)

    def forward(self, x, cache=None):
        x = x + self.self_attention(self.input_layernorm(x), cache)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Policy(nn.Module):
    def __init__(self, d, layers, heads, ff, max_len):
        super().__init__()
        lin = Linear
        self.embedding = nn.Embedding(VOCAB, d)
        self.position = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([Block(d, heads, ff, lin) for _ in range(layers)])
        self.final_layernorm = nn.LayerNorm(d)
        self.output_layer = nn.Linear(d, VOCAB, bias=False)  # LM head: never FP8

    def forward(self, tokens, start=0, caches=None):
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if caches is None else caches[i])
        return self.output_layer(self.final_layernorm(x)).float()

    def set_fp8(self, on):
        """Route the blocks' linear layers (QKV, output projection, fc1, fc2) through FP8."""
        for m in self.layers.modules():
            if isinstance(m, Linear):
                if on and (m.weight.shape[0] % 16 or m.weight.shape[1] % 16):
                    raise ValueError(f"FP8 GEMM needs features divisible by 16, got {tuple(m.weight.shape)}")
                m.fp8 = on
        return self


# ---------------------------------------------------------------------------------------------


def autocast(device, precision):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision in ("bf16", "fp8"))


@torch.no_grad()
def sync_weights(trainer, engine):
    """Export the trainer's FP32 master weights to the rollout engine's copy (in its dtype: BF16
    for bf16/fp8, as a trainer hands BF16 weights to its inference engine)."""
    for (name, src), (_, dst) in zip(trainer.named_parameters(), engine.named_parameters()):
        dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def rollout(engine, prompts, resp_len, gen):
    """The inference engine: sample resp_len tokens per row, one at a time with a KV cache, in the
    engine's own dtype (no autocast: BF16 residual stream and norms for bf16/fp8). Returns tokens
    (N, R) and the log-probability the engine gave each sampled token (N, R), FP32."""
    caches = [dict() for _ in engine.layers]
    toks, logps = [], []
    logits = engine(prompts, 0, caches)[:, -1]
    pos = prompts.shape[1]
    for r in range(resp_len):
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = torch.multinomial(lp.exp(), 1, generator=gen)
        toks.append(nxt)
        logps.append(lp.gather(1, nxt))
        if r + 1 < resp_len:
            logits = engine(nxt, pos, caches)[:, -1]
            pos += 1
    return torch.cat(toks, 1), torch.cat(logps, 1)


def response_logps(model, prompts, resp, device, precision, with_entropy=False):
    """The trainer's full-sequence forward: log p of each response token (N, R), FP32."""
    seq = torch.cat([prompts, resp], dim=1)
    p = prompts.shape[1]
    with autocast(device, precision):
        logits = model(seq[:, :-1])[:, p - 1 :]
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = lp.gather(2, resp.unsqueeze(2)).squeeze(2)
    if with_entropy:
        ent = -(lp.exp() * lp).sum(-1)
        return out, ent
    return out


def completion_mask(resp):
    """1 for tokens up to and including the first EOS (the completion), 0 after."""
    is_eos = (resp == EOS).int()
    after = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return (~after).float()


def warm_start(model, args, device, gen):
    """Supervised warm start in FP32: teacher forcing on prompt + answer + EOS, until the greedy
    accuracy on a fixed held-out set reaches ``--sft-target`` (checked every ``--sft-eval-every``
    steps) or ``--sft-steps`` steps. Returns (steps taken, greedy accuracy)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    hi = 10**args.digits
    resp_len = args.digits + 2
    acc = greedy_accuracy(model, args, device, "fp32")
    for step in range(1, args.sft_steps + 1):
        if acc >= args.sft_target:
            return step - 1, acc
        a = torch.randint(0, hi, (args.sft_batch,), generator=gen)
        b = torch.randint(0, hi, (args.sft_batch,), generator=gen)
        prompts = encode_prompts(a, b, args.digits).to(device)
        target = answer_tokens(a + b, resp_len).to(device)
        lp = response_logps(model, prompts, target, device, "fp32")
        mask = (target != PAD).float()
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.sft_eval_every == 0 or step == args.sft_steps:
            acc = greedy_accuracy(model, args, device, "fp32")
    return args.sft_steps, acc


@torch.no_grad()
def greedy_accuracy(model, args, device, precision, n=512):
    g = torch.Generator().manual_seed(12345)
    hi = 10**args.digits
    a = torch.randint(0, hi, (n,), generator=g)
    b = torch.randint(0, hi, (n,), generator=g)
    prompts = encode_prompts(a, b, args.digits).to(device)
    caches = [dict() for _ in model.layers]
    out = []
    with autocast(device, precision):
        logits = model(prompts, 0, caches)[:, -1]
        pos = prompts.shape[1]
        for r in range(args.digits + 2):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if r + 1 < args.digits + 2:
                logits = model(nxt, pos, caches)[:, -1]
                pos += 1
    reward, _ = score(torch.cat(out, 1), a + b)
    return reward.mean().item()


def layer_grad_norms(model):
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None or not name.startswith("layers.") or not name.endswith(".weight"):
            continue
        rest = name[len("layers.") :]
        layer, site = rest.split(".", 1)
        site = site.removesuffix(".weight")
        if "layernorm" in site:
            continue
        out[f"train/grad_norm/layer_{int(layer)}/{site}"] = p.grad.float().norm()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp8"], default="bf16")
    ap.add_argument("--seed", type=int, default=0, help="the RL run's seed (prompts, sampling)")
    ap.add_argument("--init-seed", type=int, default=0, help="initialisation and warm start (the shared checkpoint)")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps")
    ap.add_argument("--out", required=False, help="output folder (TensorBoard event file, run.json)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--digits", type=int, default=2, help="operand digits")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    ap.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per GRPO step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.02, help="KL-to-reference coefficient (0: no reference)")
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--tis-cap", type=float, default=2.0, help="truncated importance sampling cap")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--sft-steps", type=int, default=1000, help="most warm-start steps")
    ap.add_argument("--sft-target", type=float, default=0.35, help="warm start stops at this greedy accuracy")
    ap.add_argument("--sft-eval-every", type=int, default=10)
    ap.add_argument("--sft-batch", type=int, default=256)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--check-fp8", action="store_true", help="only check FP8 _scaled_mm against BF16 and exit")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: CUDA is not available (torch {torch.__version__})")
    if args.check_fp8:
        require_fp8(device)
        return check_fp8(device)
    if args.out is None:
        ap.error("--out is required")
    if args.precision == "fp8":
        require_fp8(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Like a real framework, every run starts from the same checkpoint: the initialisation and the
    # FP32 warm start depend on --init-seed only, never on --seed or --precision. --seed drives
    # the RL part (prompts, sampling, minibatch order).
    torch.manual_seed(args.init_seed)

    os.makedirs(args.out, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    t0 = time.time()
    resp_len = args.digits + 2
    max_len = 2 * args.digits + 2 + resp_len
    model = Policy(args.d_model, args.layers, args.heads, args.d_ff, max_len).to(device)
    data_gen = torch.Generator().manual_seed(args.init_seed)
    sft_steps, warm_acc = warm_start(model, args, device, data_gen)
    torch.manual_seed(args.seed)
    model.set_fp8(args.precision == "fp8")
    ref = None
    if args.beta > 0:
        ref = Policy(args.d_model, args.layers, args.heads, args.d_ff, max_len).to(device)
        ref.load_state_dict(model.state_dict())
        ref.requires_grad_(False)
        ref.set_fp8(args.precision == "fp8")
    # The rollout engine: a separate copy of the policy that only holds exported weights (BF16
    # unless --precision fp32) and runs without autocast; its FP8 sites are the trainer's.
    engine_dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    engine = Policy(args.d_model, args.layers, args.heads, args.d_ff, max_len).to(device, engine_dtype)
    engine.requires_grad_(False)
    engine.set_fp8(args.precision == "fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sample_gen = torch.Generator(device=device).manual_seed(args.seed + 1_000_003)
    prompt_gen = torch.Generator().manual_seed(args.seed + 2_000_003)
    writer = SummaryWriter(log_dir=args.out)
    hi = 10**args.digits
    n = args.prompts * args.group
    print(
        f"seed {args.seed} precision {args.precision} device {device}: warm start "
        f"{sft_steps} steps, greedy accuracy {warm_acc:.3f} ({time.time() - t0:.1f} s)",
        flush=True,
    )

    for step in range(1, args.steps + 1):
        ts = time.time()
        a = torch.randint(0, hi, (args.prompts,), generator=prompt_gen).repeat_interleave(args.group)
        b = torch.randint(0, hi, (args.prompts,), generator=prompt_gen).repeat_interleave(args.group)
        prompts = encode_prompts(a, b, args.digits).to(device)
        sync_weights(model, engine)
        resp, logp_rollout = rollout(engine, prompts, resp_len, sample_gen)
        reward, length = score(resp, a + b)
        reward = reward.to(device)
        mask = completion_mask(resp)
        rg = reward.view(args.prompts, args.group)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-4)).view(-1)

        # The trainer's own log-probs of what the rollout sampled ("old" log-probs).
        with torch.no_grad():
            logp_old, entropy = response_logps(model, prompts, resp, device, args.precision, with_entropy=True)
            logp_ref = response_logps(ref, prompts, resp, device, args.precision) if ref is not None else None
        msum = mask.sum()
        delta = (logp_old - logp_rollout) * mask
        ratio_is = torch.exp(logp_old - logp_rollout)
        # k3 estimate of KL(rollout || train) per token: r - 1 - log r with r = p_train / p_rollout,
        # in FP64 with expm1 so that tiny mismatches (FP32) do not round below 0.
        d64 = (logp_old - logp_rollout).double()
        k3 = ((torch.expm1(d64) - d64) * mask.double()).float()
        tis = ratio_is.clamp(max=args.tis_cap)

        perm = torch.randperm(n, generator=prompt_gen).to(device)
        chunks = perm.chunk(args.minibatches)
        clipped, kl_ref, losses, gnorms = [], [], [], []
        layer_norms = {}
        for idx in chunks:
            lp = response_logps(model, prompts[idx], resp[idx], device, args.precision)
            m = mask[idx]
            ratio = torch.exp(lp - logp_old[idx])
            a_t = adv[idx].unsqueeze(1)
            pg = -torch.min(ratio * a_t, ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps) * a_t)
            per_tok = pg * tis[idx]
            if ref is not None:
                d = logp_ref[idx] - lp
                kl_tok = torch.expm1(d) - d  # k3 of KL(policy || reference), as TRL
                per_tok = per_tok + args.beta * kl_tok
                kl_ref.append(((kl_tok * m).sum() / m.sum()).detach())
            loss = (per_tok * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            layer_norms = layer_grad_norms(model)  # the step's last optimizer step, before clipping
            gnorms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).detach())
            opt.step()
            out_of_region = ((ratio < 1 - args.clip_eps) | (ratio > 1 + args.clip_eps)).float()
            clipped.append(((out_of_region * m).sum() / m.sum()).detach())
            losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.time() - ts

        scalars = {
            "train/reward": reward.mean(),
            "train/reward_std": rg.std(1).mean(),
            "train/loss": torch.stack(losses).mean(),
            "train/grad_norm": torch.stack(gnorms).mean(),
            "train/completions/mean_length": length.float().mean(),
            "train/entropy": (entropy * mask).sum() / msum,
            "train/clip_ratio/region_mean": torch.stack(clipped).mean(),
            "train/sampling/sampling_logp_difference/mean": delta.abs().sum() / msum,
            "train/sampling/sampling_logp_difference/max": delta.abs().max(),
            "train/sampling/importance_sampling_ratio/min": ratio_is[mask > 0].min(),
            "train/sampling/importance_sampling_ratio/mean": (ratio_is * mask).sum() / msum,
            "train/sampling/importance_sampling_ratio/max": ratio_is[mask > 0].max(),
            "train/sampling/train_rollout_kl_k3": k3.sum() / msum,
            "train/step_time": torch.tensor(step_time),
        }
        if kl_ref:
            scalars["train/kl"] = torch.stack(kl_ref).mean()
        scalars.update(layer_norms)
        values = {k: float(v) for k, v in scalars.items()}
        for k, v in values.items():
            writer.add_scalar(k, v, global_step=step)
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(
                f"step {step:4d} reward {values['train/reward']:.3f} "
                f"|dlogp| {values['train/sampling/sampling_logp_difference/mean']:.2e} "
                f"kl_k3 {values['train/sampling/train_rollout_kl_k3']:.2e} "
                f"grad_norm {values['train/grad_norm']:.3f} ({step_time * 1000:.0f} ms)",
                flush=True,
            )
    writer.flush()
    writer.close()
    final_acc = greedy_accuracy(model, args, device, args.precision)
    summary = {
        "precision": args.precision,
        "fp8_sites": "layers.*.self_attention.linear_qkv/linear_proj, layers.*.mlp.linear_fc1/fc2 (forward GEMM)"
        if args.precision == "fp8"
        else None,
        "seed": args.seed,
        "init_seed": args.init_seed,
        "steps": args.steps,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "warm_start_steps": sft_steps,
        "warm_start_greedy_accuracy": warm_acc,
        "final_greedy_accuracy": final_acc,
        "wall_s": time.time() - t0,
        "args": vars(args),
    }
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"done: greedy accuracy {warm_acc:.3f} -> {final_acc:.3f} in {summary['wall_s']:.1f} s", flush=True)
    return 0


def check_fp8(device):
    """FP8 rowwise _scaled_mm against a BF16 matmul and against the same codes dequantized in FP32
    (the latter pins the scale convention: scales multiply, scale_a (M,1), scale_b (1,N))."""
    torch.manual_seed(0)
    ok = True
    for m, k, n in [(1000, 128, 384), (2048, 512, 128), (7, 128, 512)]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=device) * 0.05).to(torch.bfloat16)
        y8 = fp8_rowwise_mm(x, w).float()
        ybf = (x @ w.t()).float()
        xq, xs = quantize_rowwise(x)
        wq, ws = quantize_rowwise(w)
        yemu = (xq.float() * xs) @ (wq.float() * ws).t()
        rel = ((y8 - ybf).norm() / ybf.norm()).item()
        rel_emu = ((y8 - yemu).norm() / yemu.norm()).item()
        good = rel < 0.08 and rel_emu < 0.01
        ok &= good
        print(
            f"fp8 check {m}x{k}x{n}: rel. error vs BF16 matmul {rel:.4f} (FP8 E4M3 tolerance 0.08), "
            f"vs dequantized FP32 {rel_emu:.2e} (BF16 output rounding, < 0.01): {'ok' if good else 'FAIL'}",
            flush=True,
        )
    # Gradients through the autograd function against a BF16 linear.
    x = torch.randn(300, 128, device=device, requires_grad=True)
    lin = Linear(128, 256).to(device)
    lin.fp8 = True
    y = lin(x)
    (y.float() ** 2).mean().backward()
    gx8, gw8 = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    yb = (x.to(torch.bfloat16) @ lin.weight.to(torch.bfloat16).t()).float()
    (yb**2).mean().backward()
    for name, a, b in [("dgrad", gx8, x.grad), ("wgrad", gw8, lin.weight.grad)]:
        rel = ((a - b).norm() / b.norm()).item()
        good = rel < 0.1
        ok &= good
        print(f"fp8 check backward {name}: rel. error vs BF16 {rel:.4f} (< 0.1): {'ok' if good else 'FAIL'}", flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"fp8 check on {where}, torch {torch.__version__}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
