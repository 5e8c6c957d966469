#!/usr/bin/env python3
"""One GRPO step of lockstep's `small` MoE policy, written in plain PyTorch eager (CPU, FP32
tensors, fake quantization with ordinary tensor ops, autograd for the backward).

It is the side-by-side baseline for issue 3: the same model, shape and step as
`lockstep bench engine` (src/tools/bench_engine.rs), so the two timings can be compared on the
same machine. It mirrors, per step:

  1. export   quantize the FP32 master weights per the recipe's plan, once for the trainer and once
              for the rollout (lockstep prepares both sides and checks they agree: the "contract");
  2. rollout  KV-cache decoding of P x n sequences, one position at a time from position 0 (lockstep
              has no batched prefill: the prompt is fed token by token), BF16-rounded K/V, temperature
              sampling, per-token logprobs; it runs all T-1 positions even after every sequence has
              emitted <eos> (lockstep keeps going to record routing for replay);
  3. rewards  exact match, group-normalised advantages;
  4. train    one forward over the whole [B, T-1] batch with the rollout's routing replayed (old
              logprobs: the first minibatch reuses it), one no-grad forward of the frozen BF16
              reference (KL metric), PPO-clipped loss with truncated importance sampling (cap 2),
              backward, per-tensor and global grad norm, clipping to 1, AdamW.

Fake-quant rules (src/engine/linear.rs): at a `bf16` site both matmul operands are rounded to BF16
and the product is an FP32 matmul; the backward GEMMs use BF16 weights, BF16 saved activations and
a BF16-rounded incoming gradient. At an `nvfp4/dq` site (recipe nvfp4-dq: routed experts fc1/fc2 of
layers 0-4) the weight is NVFP4 with a per-tensor (per-expert) second-level scale, the activation is
NVFP4 with a per-token second-level scale, and the backward uses the dequantized operands (rounded to
BF16). Weights are prepared once per step and the gradient goes straight through to the FP32
master weight, as in lockstep.

Every preset `lockstep bench engine` times has its fake quantization here: MXFP8 (E4M3, TE's ceil
scale) and FP8 blocks (1 x 128 activations, 128 x 128 weights) as well, with the high-precision,
dequantized or quantized backward of the recipe (see RECIPES below).

Usage:  python3 bench/pytorch_step.py --recipe bf16        (a comma-separated list, or all)
        python3 bench/pytorch_step.py --json ...           (what `lockstep bench engine --pytorch` runs)
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Shape (ModelConfig::small(), bench_grpo(), Task::Add(3))

VOCAB, D, H, L, E, TOPK, FF, FFS, MAX_SEQ = 32, 128, 4, 6, 8, 2, 256, 256, 32
DH = D // H
PROMPTS, SAMPLES, MAX_NEW = 32, 8, 8
DIGITS = 3
PROMPT_LEN = 2 * DIGITS + 2  # "123+456="
PLUS, EQ, EOS, PAD = 10, 11, 12, 13
RMS_EPS = 1e-6
TEMPERATURE = 1.0
LR, BETAS, ADAM_EPS, WD_BF16 = 1e-3, (0.9, 0.999), 1e-8, 0.01
GRAD_CLIP, CLIP_LOW, CLIP_HIGH, TIS_CAP = 1.0, 0.2, 0.28, 2.0

# Every preset `lockstep bench engine` times, as (format, backward mode, sites) on layers 0-4
# (`lockstep recipe show RECIPE --model small`): the last layer, the router, the shared expert
# and the output layer stay BF16 in all of them. Modes: hp = the backward GEMMs use the BF16
# operands, dq = the dequantized ones (rounded to BF16), q = fresh quantizations along the
# backward's contraction dimension.
LOW_LAYERS = {0, 1, 2, 3, 4}
DENSE = {"qkv", "proj", "fc1", "fc2"}
EXPERTS = {"fc1", "fc2"}
RECIPES = {
    "bf16": (None, None, set()),
    "mxfp8": ("mxfp8", "q", DENSE),
    "mxfp8-hp": ("mxfp8", "hp", DENSE),
    "mxfp8-dq": ("mxfp8", "dq", DENSE),
    "nvfp4-hp": ("nvfp4", "hp", EXPERTS),
    "nvfp4-dq": ("nvfp4", "dq", EXPERTS),
    "fp8-block": ("fp8-block", "q", DENSE),
}

FLT_MAX = torch.finfo(torch.float32).max

# ----------------------------------------------------------------------------------------------
# Fake quantization


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def e2m1_round(s):
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (RNE), saturating at 6."""
    a = s.abs().clamp(max=6.0)
    r = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                    torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.copysign(r, s)


def nvfp4(x, per_token):
    """Fake-quantize x [..., K] to NVFP4: 16-element blocks along K, E2M1 codes, E4M3 block scale,
    FP32 second-level scale from the amax of each row (per token) or of the whole tensor."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // 16, 16)
    vec_max = xb.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    amax = vec_max.amax(dim=-2, keepdim=True) if per_token else vec_max.amax()
    s_enc = (2688.0 / amax).clamp(max=FLT_MAX)
    s_dec = 1.0 / s_enc
    scale = (vec_max * (s_enc * (1.0 / 6.0))).clamp(max=448.0)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    enc = (1.0 / (scale * s_dec)).clamp(max=FLT_MAX)
    codes = e2m1_round(xb * enc)
    return (codes * (scale * amax * (1.0 / 2688.0))).reshape(shape)


def mxfp8(x):
    """Fake-quantize x [..., K] to MXFP8: 32-element blocks along K, E4M3 codes, E8M0 scale by
    TE's rule (the block amax over 448, rounded up to a power of two; NaN ignored)."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // 32, 32)
    amax = torch.nan_to_num(xb.abs(), nan=0.0).amax(dim=-1, keepdim=True)
    bits = (amax * (1.0 / 448.0)).view(torch.int32)
    b = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=253)
    inv = ((254 - b) << 23).view(torch.float32)
    q = (xb * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return (q / inv).reshape(shape)


def fp8_block(x, tile):
    """Fake-quantize x [M, K] to FP8 (E4M3) in 1 x 128 (activations) or 128 x 128 (weights)
    tiles, each scaled by its amax over 448."""
    m, k = x.shape
    r = 1 if tile == "1x128" else 128
    xb = x.reshape(m // r, r, k // 128, 128)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = 448.0 / amax
    q = (xb * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return (q / scale).reshape(m, k)


def weight_q(fmt, w):
    """A weight quantized along K (its rows), as the forward reads it."""
    if fmt == "nvfp4":
        return nvfp4(w, per_token=False)
    if fmt == "mxfp8":
        return mxfp8(w)
    return fp8_block(w, "128x128")


def act_q(fmt, x):
    """An activation (or incoming gradient) quantized along its last dimension."""
    if fmt == "nvfp4":
        return nvfp4(x, per_token=True)
    if fmt == "mxfp8":
        return mxfp8(x)
    return fp8_block(x, "1x128")


BLOCK = {"nvfp4": 16, "mxfp8": 32, "fp8-block": 128}


def padded(q, fmt, x):
    """`q(x)` with x's last dimension padded with zeros to a whole block (tokens routed to an
    expert, the router's 8 rows), as lockstep and TE's grouped GEMMs do."""
    k = x.shape[-1]
    pad = -k % BLOCK[fmt]
    return q(F.pad(x, (0, pad)))[..., :k] if pad else q(x)


def cols(q, fmt, x):
    """`q` along x's first dimension: the backward's column-wise copy, blocks along tokens."""
    return padded(q, fmt, x.t().contiguous()).t()


class QLinear(torch.autograd.Function):
    """y = q(x) @ w_fwd.T; backward: dx = dy_d @ w_bwd, dW = dy_w.T @ x_bwd, straight through
    to the master weight `w`, each operand per the site's backward mode."""

    @staticmethod
    def forward(ctx, x, w, site):
        fmt, mode = site.fmt, site.mode
        x_hp = bf16(x)
        xq = act_q(fmt, x_hp) if fmt else x_hp
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            if fmt is None or mode == "hp":
                x_bwd = x_hp
            elif mode == "dq":
                x_bwd = bf16(xq)
            else:
                x_bwd = cols(lambda t: act_q(fmt, t), fmt, x_hp)
            ctx.site = site
            ctx.save_for_backward(x_bwd)
        return xq @ site.w_fwd.t()

    @staticmethod
    def backward(ctx, dy):
        (x_bwd,) = ctx.saved_tensors
        site = ctx.site
        dy = bf16(dy)
        dy_d = dy_w = dy
        if site.fmt is not None and site.mode == "q":
            q = lambda t: act_q(site.fmt, t)
            dy_d, dy_w = padded(q, site.fmt, dy), cols(q, site.fmt, dy)
        return dy_d @ site.w_bwd, dy_w.t() @ x_bwd, None


class Site:
    """A matmul site prepared for this step: master weight, forward and dgrad operands."""

    __slots__ = ("w", "w_fwd", "w_bwd", "fmt", "mode")

    def __init__(self, w, fmt=None, mode=None):
        with torch.no_grad():
            hp = bf16(w)
            if fmt is None:
                self.w_fwd = self.w_bwd = hp
            else:
                self.w_fwd = weight_q(fmt, hp)
                self.w_bwd = {"hp": hp, "dq": bf16(self.w_fwd)}.get(mode)
                if self.w_bwd is None:
                    self.w_bwd = cols(lambda t: weight_q(fmt, t), fmt, hp)
        self.w, self.fmt, self.mode = w, fmt, mode

    def __call__(self, x):
        return QLinear.apply(x, self.w, self)


# ----------------------------------------------------------------------------------------------
# Parameters (Params::init: same distributions; not the same random numbers)


def init_params(seed):
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).requires_grad_()

    fan = lambda n: 1.0 / math.sqrt(n)
    resid = fan(2 * L)
    p = {"wte": normal(VOCAB, D, std=1.0), "wpe": normal(MAX_SEQ, D, std=0.5), "layers": []}
    for _ in range(L):
        p["layers"].append({
            "attn_norm": torch.ones(D, requires_grad=True),
            "qkv": normal(3 * D, D, std=fan(D)),
            "proj": normal(D, D, std=fan(D) * resid),
            "mlp_norm": torch.ones(D, requires_grad=True),
            "router": normal(E, D, std=fan(D)),
            # One tensor per expert (the usual nn.ModuleList-of-experts layout).
            "fc1": [normal(2 * FF, D, std=fan(D)) for _ in range(E)],
            "fc2": [normal(D, FF, std=fan(FF) * resid) for _ in range(E)],
            "sh_fc1": normal(2 * FFS, D, std=fan(D)),
            "sh_fc2": normal(D, FFS, std=fan(FFS) * resid),
        })
    p["final_norm"] = torch.ones(D, requires_grad=True)
    p["output"] = normal(VOCAB, D, std=0.5 * fan(D))
    return p


def param_groups(p, recipe):
    """AdamW groups: weight decay 0.01 on BF16 matmul weights, 0 on low-precision ones,
    embeddings and gains."""
    _, _, sites = RECIPES[recipe]
    decay, no_decay = [p["output"]], [p["wte"], p["wpe"], p["final_norm"]]
    for i, l in enumerate(p["layers"]):
        no_decay += [l["attn_norm"], l["mlp_norm"]]
        decay += [l["router"], l["sh_fc1"], l["sh_fc2"]]
        for name in ("qkv", "proj", "fc1", "fc2"):
            ws = l[name] if isinstance(l[name], list) else [l[name]]
            (no_decay if i in LOW_LAYERS and name in sites else decay).extend(ws)
    return [{"params": decay, "weight_decay": WD_BF16}, {"params": no_decay, "weight_decay": 0.0}]


def all_params(p):
    out = [p["wte"], p["wpe"]]
    for l in p["layers"]:
        out += [l["attn_norm"], l["qkv"], l["proj"], l["mlp_norm"], l["router"]]
        out += l["fc1"] + l["fc2"] + [l["sh_fc1"], l["sh_fc2"]]
    return out + [p["final_norm"], p["output"]]


def prepare(p, recipe):
    """PreparedModel::new: every matmul site quantized for this step."""
    fmt, mode, sites = RECIPES[recipe]
    layers = []
    for i, l in enumerate(p["layers"]):
        def site(name, w):
            low = i in LOW_LAYERS and name in sites
            return Site(w, fmt, mode) if low else Site(w)
        layers.append({
            "attn_norm": l["attn_norm"], "mlp_norm": l["mlp_norm"],
            "qkv": site("qkv", l["qkv"]), "proj": site("proj", l["proj"]),
            "router": Site(l["router"]),
            "fc1": [site("fc1", w) for w in l["fc1"]], "fc2": [site("fc2", w) for w in l["fc2"]],
            "sh_fc1": Site(l["sh_fc1"]), "sh_fc2": Site(l["sh_fc2"]),
        })
    return {"wte": p["wte"], "wpe": p["wpe"], "layers": layers,
            "final_norm": p["final_norm"], "output": Site(p["output"])}


def detached_copy(p):
    """The weights as shipped to the rollout (a copy, no autograd)."""
    c = lambda t: t.detach().clone()
    out = {"wte": c(p["wte"]), "wpe": c(p["wpe"]), "final_norm": c(p["final_norm"]),
           "output": c(p["output"]), "layers": []}
    for l in p["layers"]:
        out["layers"].append({k: ([c(t) for t in v] if isinstance(v, list) else c(v))
                              for k, v in l.items()})
    return out


def sites_of(prep):
    for l in prep["layers"]:
        yield from [l["qkv"], l["proj"], l["router"], *l["fc1"], *l["fc2"], l["sh_fc1"], l["sh_fc2"]]
    yield prep["output"]


# ----------------------------------------------------------------------------------------------
# Model


def rmsnorm(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * g


def swiglu_ffn(x, fc1, fc2):
    gate, up = fc1(x).chunk(2, dim=-1)
    return fc2(F.silu(gate) * up)


def moe(x, w, replay_ids=None):
    """x [N, D] -> x + shared(xn) + sum_j gate_j * expert_{id_j}(xn); returns (out, ids [N, K])."""
    xn = rmsnorm(x, w["mlp_norm"])
    probs = torch.softmax(w["router"](xn), dim=-1)
    ids = probs.topk(TOPK, dim=-1).indices if replay_ids is None else replay_ids
    gates = probs.gather(1, ids)
    gates = gates / gates.sum(-1, keepdim=True)  # renormalised over the top-k, as lockstep does
    out = x + swiglu_ffn(xn, w["sh_fc1"], w["sh_fc2"])
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        ye = swiglu_ffn(xn[tok], w["fc1"][e], w["fc2"][e])
        out = out.index_add(0, tok, ye * gates[tok, slot].unsqueeze(1))
    return out, ids


def forward(prep, tokens, replay=None):
    """Full causal forward over tokens [B, T]; returns logits [B*T, V] and routing [L][B*T, K]."""
    b, t = tokens.shape
    h = (prep["wte"][tokens] + prep["wpe"][:t]).reshape(b * t, D)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    routing = []
    for i, w in enumerate(prep["layers"]):
        qkv = w["qkv"](rmsnorm(h, w["attn_norm"])).view(b, t, 3, H, DH).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(DH))
        att = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
        h = h + w["proj"](att.transpose(1, 2).reshape(b * t, D))
        h, ids = moe(h, w, None if replay is None else replay[i])
        routing.append(ids)
    return prep["output"](rmsnorm(h, prep["final_norm"])), routing


@torch.no_grad()
def decode_step(prep, kcache, vcache, tokens, pos):
    """One position for every sequence against the BF16 KV cache; logits [B, V], routing."""
    b = tokens.shape[0]
    h = prep["wte"][tokens] + prep["wpe"][pos]
    routing = []
    for i, w in enumerate(prep["layers"]):
        qkv = w["qkv"](rmsnorm(h, w["attn_norm"])).view(b, 3, H, DH)
        kcache[i][:, :, pos] = bf16(qkv[:, 1])
        vcache[i][:, :, pos] = bf16(qkv[:, 2])
        q = qkv[:, 0].unsqueeze(2)  # [B, H, 1, Dh]
        k, v = kcache[i][:, :, : pos + 1], vcache[i][:, :, : pos + 1]
        p = torch.softmax((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(DH)), dim=-1)
        h = h + w["proj"]((p @ v).reshape(b, D))
        h, ids = moe(h, w)
        routing.append(ids)
    return prep["output"](rmsnorm(h, prep["final_norm"])), routing


# ----------------------------------------------------------------------------------------------
# Task, rollout, step


def sample_problems(n, g):
    digits = torch.randint(0, 10, (n, 2 * DIGITS), generator=g)
    prompts, answers = [], []
    for row in digits.tolist():
        a, b = row[:DIGITS], row[DIGITS:]
        prompts.append(a + [PLUS] + b + [EQ])
        s = int("".join(map(str, a))) + int("".join(map(str, b)))
        answers.append([(s // 10 ** j) % 10 for j in range(DIGITS + 1)] + [EOS])
    return torch.tensor(prompts), answers


@torch.no_grad()
def rollout(prep, prompts, g):
    b, t = prompts.shape[0] * SAMPLES, PROMPT_LEN + MAX_NEW
    tokens = torch.full((b, t), PAD, dtype=torch.long)
    tokens[:, :PROMPT_LEN] = prompts.repeat_interleave(SAMPLES, dim=0)
    logprobs = torch.zeros(b, t)
    resp_len = torch.zeros(b, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    kcache = [torch.zeros(b, H, MAX_SEQ, DH) for _ in range(L)]
    vcache = [torch.zeros(b, H, MAX_SEQ, DH) for _ in range(L)]
    steps = []
    for pos in range(t - 1):
        logits, routing = decode_step(prep, kcache, vcache, tokens[:, pos], pos)
        steps.append(routing)
        nxt = pos + 1
        if nxt < PROMPT_LEN or bool(done.all()):
            continue  # reading the prompt, or everyone finished (routing still recorded)
        lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        tok = torch.multinomial(lp.exp(), 1, generator=g).squeeze(1)
        live = ~done
        tokens[live, nxt] = tok[live]
        logprobs[live, nxt] = lp.gather(1, tok.unsqueeze(1)).squeeze(1)[live]
        resp_len += live.long()
        done |= live & (tok == EOS)
    # Routing replay record: per layer [B*(T-1), K], sequence-major.
    replay = [torch.stack([s[i] for s in steps], dim=1).reshape(b * (t - 1), TOPK) for i in range(L)]
    return tokens, logprobs, resp_len, done, replay


def rewards_of(tokens, resp_len, answers):
    r = []
    for s in range(tokens.shape[0]):
        resp = tokens[s, PROMPT_LEN: PROMPT_LEN + resp_len[s]].tolist()
        if EOS in resp:
            resp = resp[: resp.index(EOS) + 1]
        r.append(1.0 if resp == answers[s // SAMPLES] else 0.0)
    r = torch.tensor(r).view(-1, SAMPLES)
    m, sd = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    adv = torch.where(sd > 0, (r - m) / (sd + 1e-6), torch.zeros_like(r))
    return r.flatten(), adv.flatten()


class Trainer:
    def __init__(self, recipe, seed=7):
        self.recipe = recipe
        self.params = init_params(seed)
        self.flat = all_params(self.params)
        self.opt = torch.optim.AdamW(param_groups(self.params, recipe), lr=LR, betas=BETAS,
                                     eps=ADAM_EPS)
        # Frozen BF16 reference (prepared once, as lockstep does at Trainer::new).
        self.reference = prepare(detached_copy(self.params), "bf16")
        self.g = torch.Generator().manual_seed(seed + 1)

    def step(self):
        rec = {}
        t_step = time.perf_counter()
        # 1. Export: the trainer's prepared view and the rollout's own, from shipped weights.
        t0 = time.perf_counter()
        train_prep = prepare(self.params, self.recipe)
        roll_prep = prepare(detached_copy(self.params), self.recipe)
        rec["contract_violations"] = sum(
            not torch.equal(a.w_fwd, b.w_fwd) for a, b in zip(sites_of(train_prep), sites_of(roll_prep)))
        rec["export"] = time.perf_counter() - t0

        # 2. Rollout.
        t0 = time.perf_counter()
        prompts, answers = sample_problems(PROMPTS, self.g)
        tokens, ro_lp, resp_len, done, replay = rollout(roll_prep, prompts, self.g)
        rec["rollout"] = time.perf_counter() - t0
        rec["response_len"] = resp_len.float().mean().item()

        # 3. Rewards and advantages.
        raw, adv = rewards_of(tokens, resp_len, answers)
        rec["reward"] = raw.mean().item()

        # 4. Train.
        t0 = time.perf_counter()
        rec.update(self.train_on(train_prep, tokens, ro_lp, resp_len, adv, replay))
        rec["train"] = time.perf_counter() - t0
        rec["step"] = time.perf_counter() - t_step
        return rec

    def train_on(self, prep, tokens, ro_lp, resp_len, adv, replay):
        b, t = tokens.shape
        t_in = t - 1
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(1, t).unsqueeze(0)
        mask = ((pos >= PROMPT_LEN) & (pos < PROMPT_LEN + resp_len.unsqueeze(1))).flatten()
        n_tok = max(int(mask.sum()), 1)
        tgt = targets.reshape(-1, 1)
        ro_lp = ro_lp[:, 1:].reshape(-1)
        out = {}

        logits, _ = forward(prep, inputs, replay)
        logp_full = torch.log_softmax(logits, dim=-1)
        lp = logp_full.gather(1, tgt).squeeze(1)
        lp0 = lp.detach()  # old logprobs: the first minibatch reuses this forward
        with torch.no_grad():
            d = (lp0 - ro_lp)[mask]
            out["mismatch_k3"] = (d.exp() - 1 - d).mean().item()
            out["entropy"] = -(logp_full.exp() * logp_full).sum(-1)[mask].mean().item()
            ref_logits, _ = forward(self.reference, inputs, replay)
            lp_ref = torch.log_softmax(ref_logits, dim=-1).gather(1, tgt).squeeze(1)
            dr = (lp_ref - lp0)[mask]
            out["kl_ref"] = (dr.exp() - 1 - dr).mean().item()

        a = adv.repeat_interleave(t_in)
        ratio = torch.exp(lp - lp0)
        tis = torch.exp(lp0 - ro_lp).clamp(max=TIS_CAP)
        clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
        loss = (-(tis * torch.minimum(ratio * a, clipped * a)) * mask).sum() / n_tok
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.flat]
        norms = torch.stack([g.norm() for g in grads])  # per tensor (lockstep: per site and layer)
        total = norms.norm().item()
        if total > GRAD_CLIP:
            torch._foreach_mul_(grads, GRAD_CLIP / (total + 1e-6))
        for p, g in zip(self.flat, grads):
            p.grad = g
        self.opt.step()
        out["loss"] = loss.item()
        out["grad_norm"] = total
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="all",
                    help="comma-separated presets (" + ", ".join(RECIPES) + ") or all")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true",
                    help="one JSON object per recipe (median seconds), for `lockstep bench engine`")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    recipes = list(RECIPES) if args.recipe == "all" else args.recipe.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe {unknown[0]!r}: one of {', '.join(RECIPES)}")
    if args.json:
        for name in recipes:
            tr = Trainer(name)
            tr.step()  # warm-up
            recs = [tr.step() for _ in range(args.steps)]
            assert all(r["contract_violations"] == 0 for r in recs)
            med = {k: statistics.median(r[k] for r in recs)
                   for k in ("step", "export", "rollout", "train")}
            print(json.dumps({"recipe": name, "torch": torch.__version__,
                              "threads": torch.get_num_threads(), **med}), flush=True)
        return
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = ""
    try:
        cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"shape: {L} layers, d_model {D}, {H} heads, {E} experts top-{TOPK}, FFN {FF}, vocab {VOCAB}, "
          f"{PROMPTS} prompts x {SAMPLES} samples, max {MAX_NEW} response tokens, add:{DIGITS}")
    print(f"{'recipe':<10} {'step s':>8} {'export s':>9} {'rollout s':>10} {'train s':>8} "
          f"{'resp len':>9} {'min step':>9} {'max step':>9}")
    for name in recipes:
        tr = Trainer(name)
        tr.step()  # warm-up
        recs = [tr.step() for _ in range(args.steps)]
        med = lambda k: statistics.median(r[k] for r in recs)
        assert all(r["contract_violations"] == 0 for r in recs)
        print(f"{name:<10} {med('step'):>8.3f} {med('export'):>9.3f} {med('rollout'):>10.3f} "
              f"{med('train'):>8.3f} {statistics.mean(r['response_len'] for r in recs):>9.2f} "
              f"{min(r['step'] for r in recs):>9.3f} {max(r['step'] for r in recs):>9.3f}")
    try:
        load = os.getloadavg()
        print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    except OSError:
        pass


if __name__ == "__main__":
    main()
