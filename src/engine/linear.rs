//! The precision-aware linear layer: `y = x · Wᵀ` with operands quantized per the site's
//! [`SitePlan`], and its backward in the plan's [`BackwardMode`]. Every matmul site of the model goes
//! through here, and every quantization goes through `crate::formats` (the one quantizer).
//!
//! Shapes: `x` is `[n, k]` (n tokens), `W` is `[m, k]` (out x in, as torch/Megatron store it),
//! `y` is `[n, m]`. Forward operands are quantized along K (rows of both). The backward GEMMs
//! contract over other dimensions: dgrad `dx = dy · W` over m, wgrad `dW = dyᵀ · x` over n, so in
//! `Quantized` mode their operands are fresh column-wise quantizations of the high-precision
//! originals (never re-quantized from the row-wise copy), blocks along the contraction dimension.
//! When that dimension is not a multiple of the block (tokens routed to one expert, 8 router
//! rows) it is padded with zeros, which changes no amax and so no code (what TE's padded grouped
//! GEMMs do).
//!
//! "High precision" means BF16: low-precision sites read their operands as the BF16 values a
//! BF16 model holds (weights are `bf16(master)`), so the rollout, which receives BF16 weights,
//! quantizes the same tensor to the same bytes. FP32 sites (gradient checks) never round.

use super::backend::cpu::{MatRef, gemm};
use crate::formats::bf16::round_bf16;
use crate::formats::{
    Axis, QuantFormat, QuantStats, QuantizedTensor, Scales, fake_quantize, quantize,
};
use crate::recipe::{BackwardMode, Precision, SitePlan};
use sha2::{Digest, Sha256};
use std::borrow::{Borrow, BorrowMut};
use std::ops::Range;

/// A weight prepared once per optimizer step: the operands the forward and the dgrad GEMM use.
/// `w_fwd` is what the rollout computes with; `digest` hashes the quantized bytes behind it.
#[derive(Debug, Clone)]
pub struct PreparedWeight {
    pub out_dim: usize,
    pub in_dim: usize,
    /// Forward operand (quantized then dequantized to FP32). Private, like `w_bwd`: both are
    /// immutable once prepared, which is what `key` relies on.
    w_fwd: Vec<f32>,
    /// Operand of the dgrad GEMM (`dx = dy · W`), chosen by the backward mode; `None` where it
    /// equals `w_fwd` bit for bit (FP32 and BF16 sites, and most dequantized ones), so it is
    /// neither stored nor copied to a device twice.
    w_bwd: Option<Vec<f32>>,
    /// Unique per preparation (see [`PreparedWeight::key`]).
    key: u64,
    /// SHA-256 over the weight's codes, scales and second-level scales (FP32 values for FP32 sites).
    pub digest: [u8; 32],
    /// Saturation/underflow of the weight quantization.
    pub stats: QuantStats,
}

impl PreparedWeight {
    /// Forward operand (quantized then dequantized to FP32).
    pub fn w_fwd(&self) -> &[f32] {
        &self.w_fwd
    }
    /// Operand of the dgrad GEMM, chosen by the backward mode.
    pub fn w_bwd(&self) -> &[f32] {
        self.w_bwd.as_deref().unwrap_or(&self.w_fwd)
    }
    /// True when the dgrad operand is the forward operand (bit for bit).
    pub fn bwd_is_fwd(&self) -> bool {
        self.w_bwd.is_none()
    }
    /// Names this preparation's contents: clones share it, every new preparation gets a new one.
    pub fn key(&self) -> u64 {
        self.key
    }
}

/// A fresh content key for a prepared weight (process-wide, never reused).
fn next_weight_key() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What the forward keeps for the backward.
#[derive(Debug, Clone)]
pub struct LinearCache {
    /// Operand of the wgrad GEMM (`dW = dyᵀ · x`), chosen by the backward mode.
    pub x_bwd: Vec<f32>,
    pub n: usize,
    /// Saturation/underflow of the activation quantization.
    pub stats: QuantStats,
}

fn bf16_vec(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| round_bf16(*v)).collect()
}

/// Hash of a quantized tensor's bytes (codes, scales, second-level scales).
pub fn digest_of(q: &QuantizedTensor) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(&q.codes);
    match &q.scales {
        Scales::None => {}
        Scales::E8m0(s) | Scales::E4m3(s) => h.update(s),
        Scales::F32(s) => s.iter().for_each(|v| h.update(v.to_le_bytes())),
    }
    q.global_amax.iter().for_each(|v| h.update(v.to_le_bytes()));
    h.finalize().into()
}

fn digest_f32(x: &[f32]) -> [u8; 32] {
    let mut h = Sha256::new();
    x.iter().for_each(|v| h.update(v.to_le_bytes()));
    h.finalize().into()
}

/// Column-wise (blocks along the row dimension) fake quantization of `[r, c]`, padding `r` with
/// zero rows up to the block multiple.
fn fake_quantize_col_padded(x: &[f32], r: usize, c: usize, fmt: &QuantFormat) -> Vec<f32> {
    let m = fmt.required_multiple();
    let rp = r.div_ceil(m) * m;
    let mut out = vec![0.0f32; rp * c];
    if rp == r {
        fake_quantize(x, r, c, fmt, Axis::Col, &mut out)
            .expect("blocked dimension is a multiple of the block");
        return out;
    }
    let mut padded = vec![0.0f32; rp * c];
    padded[..r * c].copy_from_slice(x);
    fake_quantize(&padded, rp, c, fmt, Axis::Col, &mut out)
        .expect("padded to a multiple of the block");
    out.truncate(r * c);
    out
}

/// Check that a site of this shape can be quantized under `plan` (K must divide into blocks).
pub fn check_site(
    plan: &SitePlan,
    out_dim: usize,
    in_dim: usize,
) -> Result<(), crate::formats::FormatError> {
    for fmt in [plan.weight_format(), plan.activation_format()]
        .into_iter()
        .flatten()
    {
        let probe = vec![0.0f32; out_dim.max(1) * in_dim];
        quantize(&probe, out_dim.max(1), in_dim, &fmt, Axis::Row)?;
    }
    Ok(())
}

/// Quantize a weight `[out_dim, in_dim]` for this step. Panics only if the shape was not checked
/// with [`check_site`] (the engine checks every site before training).
pub fn prepare_weight(plan: &SitePlan, w: &[f32], out_dim: usize, in_dim: usize) -> PreparedWeight {
    assert_eq!(w.len(), out_dim * in_dim);
    let Some(fmt) = plan.weight_format() else {
        return PreparedWeight {
            out_dim,
            in_dim,
            w_fwd: w.to_vec(),
            w_bwd: None,
            key: next_weight_key(),
            digest: digest_f32(w),
            stats: QuantStats::default(),
        };
    };
    let w_hp = bf16_vec(w);
    let q = quantize(&w_hp, out_dim, in_dim, &fmt, Axis::Row)
        .expect("site shape checked by check_site");
    let w_fwd = q.dequantize();
    let w_bwd = match dgrad_operand(plan) {
        DgradOperand::HighPrecision => w_hp,
        DgradOperand::DequantizedBf16 => bf16_vec(&w_fwd),
        DgradOperand::ColumnQuantized => fake_quantize_col_padded(&w_hp, out_dim, in_dim, &fmt),
    };
    let same = w_bwd.len() == w_fwd.len()
        && w_bwd
            .iter()
            .zip(&w_fwd)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    let w_bwd = (!same).then_some(w_bwd);
    PreparedWeight {
        out_dim,
        in_dim,
        w_fwd,
        w_bwd,
        key: next_weight_key(),
        digest: digest_of(&q),
        stats: q.stats,
    }
}

/// The dgrad GEMM's weight operand of a site whose weight is quantized, by the backward mode
/// (every device prepares it by this rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DgradOperand {
    /// The BF16-rounded master weight (BF16 sites, whose forward operand it also is, and the
    /// high-precision backward).
    HighPrecision,
    /// The forward operand rounded to BF16.
    DequantizedBf16,
    /// The BF16-rounded weight fake-quantized along columns, rows padded to the block.
    ColumnQuantized,
}

/// Which dgrad operand `plan` asks for (meaningful where `plan.weight_format()` is `Some`).
pub fn dgrad_operand(plan: &SitePlan) -> DgradOperand {
    match (plan.precision, plan.backward) {
        (Precision::Bf16, _) | (_, BackwardMode::HighPrecision) => DgradOperand::HighPrecision,
        (_, BackwardMode::Dequantized) => DgradOperand::DequantizedBf16,
        (_, BackwardMode::Quantized) => DgradOperand::ColumnQuantized,
    }
}

/// What a GEMM's operands hold. Where both hold only BF16 values their products are exact in
/// FP32, so a device may multiply them on BF16 tensor cores accumulating in FP32: the result
/// differs from an FP32 GEMM's only in how the sums are ordered and rounded, as one FP32 GEMM
/// differs from another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operands {
    /// Any FP32 values.
    Fp32,
    /// Only BF16 values, in both operands ([`QuantFormat::decodes_to_bf16`]).
    Bf16,
}

impl Operands {
    fn of(both_bf16: bool) -> Operands {
        if both_bf16 {
            Operands::Bf16
        } else {
            Operands::Fp32
        }
    }

    /// The operands of a GEMM over several plan groups: BF16 only where every group's are.
    fn all(groups: &[PlanGroup<'_>], each: impl Fn(&SitePlan) -> Operands) -> Operands {
        Operands::of(groups.iter().all(|g| each(g.plan) == Operands::Bf16))
    }
}

/// Whether a format's values (`None`: FP32, unrounded) are all BF16 values.
fn bf16_values(fmt: Option<QuantFormat>) -> bool {
    fmt.is_some_and(|f| f.decodes_to_bf16())
}

/// The forward GEMM's operands under `plan`: the quantized input and the forward weight.
pub fn forward_operands(plan: &SitePlan) -> Operands {
    Operands::of(bf16_values(plan.activation_format()) && bf16_values(plan.weight_format()))
}

/// dy as the backward's GEMMs read it: BF16-rounded, and quantized in the `Quantized` mode of a
/// site that is not BF16 (see `dy_operands`).
fn dy_is_bf16(plan: &SitePlan) -> bool {
    plan.activation_format()
        .is_some_and(|f| !dy_quantized(plan) || f.decodes_to_bf16())
}

/// Whether the backward quantizes dy (the `Quantized` mode of a site that is not BF16), which
/// then makes dgrad and wgrad operands apart (see `dy_operands`).
fn dy_quantized(plan: &SitePlan) -> bool {
    plan.precision != Precision::Bf16 && plan.backward == BackwardMode::Quantized
}

/// The dgrad GEMM's operands under `plan`: dy and the dgrad weight ([`dgrad_operand`]).
pub fn dgrad_operands(plan: &SitePlan) -> Operands {
    let w = plan
        .weight_format()
        .is_some_and(|f| match dgrad_operand(plan) {
            DgradOperand::HighPrecision | DgradOperand::DequantizedBf16 => true,
            DgradOperand::ColumnQuantized => f.decodes_to_bf16(),
        });
    Operands::of(dy_is_bf16(plan) && w)
}

/// The wgrad GEMM's operands under `plan`: dy and the kept input (`wgrad_operand`).
pub fn wgrad_operands(plan: &SitePlan) -> Operands {
    let x = plan.activation_format().is_some_and(|f| {
        plan.precision == Precision::Bf16
            || match plan.backward {
                BackwardMode::HighPrecision | BackwardMode::Dequantized => true,
                BackwardMode::Quantized => f.decodes_to_bf16(),
            }
    });
    Operands::of(dy_is_bf16(plan) && x)
}

/// One of the site's quantizations (every one through the one quantizer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteQuant {
    /// Blocks along rows: the forward's activations (contraction over K).
    Rows,
    /// Blocks along rows, the columns zero-padded to the block multiple: dgrad's dy (contraction
    /// over m, which may not divide into blocks, e.g. the 8-wide router).
    RowsPadded,
    /// Blocks along columns, the rows (tokens) zero-padded: the `Quantized` wgrad operands
    /// (contraction over tokens).
    ColsPadded,
}

/// `batch` row-major `[rows, cols]` tensors stored back to back (1 but for a device that stacks
/// the routed experts).
#[derive(Clone, Copy, Debug)]
pub struct Blocks {
    pub rows: usize,
    pub cols: usize,
    pub batch: usize,
}

/// Where a quantization adds its activation counts (elements, saturated, underflowed): its
/// tensor's blocks in `slots` equal parts, part `i` counted into slot `first + i` of `counts`. A
/// device stepping several runs gives each run a slot, so the forward's own quantization counts
/// every run on its own.
pub struct CountSlots<'a, C: ?Sized> {
    pub counts: &'a mut C,
    pub first: usize,
    pub slots: usize,
}

impl<C: ?Sized> CountSlots<'_, C> {
    /// The one slot that part `i` of `parts` equal parts of the tensor counts into (`parts` a
    /// multiple of `slots`: a block of a stacked site, quantized on its own).
    pub fn part(&mut self, i: usize, parts: usize) -> CountSlots<'_, C> {
        CountSlots {
            counts: &mut *self.counts,
            first: self.first + i / (parts / self.slots),
            slots: 1,
        }
    }
}

/// A forward's activation counts: one slot per run of the site, each run owning `batch / runs`
/// consecutive blocks.
pub struct RunCounts<'a, C: ?Sized> {
    pub counts: &'a mut C,
    pub runs: usize,
}

impl<C: ?Sized> RunCounts<'_, C> {
    /// The slots of the runs that own `blocks` of a site of `batch` blocks.
    fn slots(&mut self, blocks: &Range<usize>, batch: usize) -> CountSlots<'_, C> {
        let per_run = batch / self.runs;
        assert!(
            per_run > 0 && batch.is_multiple_of(self.runs),
            "{} runs' counts over a site of {batch} blocks",
            self.runs
        );
        CountSlots {
            counts: &mut *self.counts,
            first: blocks.start / per_run,
            slots: blocks.len() / per_run,
        }
    }
}

/// A site's weight operands as a device stores them: `batch` weights `[out_dim, in_dim]`.
pub struct SiteWeight<'a, B: ?Sized> {
    /// The forward operand (what the rollout computes with).
    pub fwd: &'a B,
    /// The dgrad operand, chosen by the backward mode.
    pub bwd: &'a B,
    pub out_dim: usize,
    pub in_dim: usize,
    pub batch: usize,
}

/// The kernels the linear layer's precision policy runs on: one device's storage, rounding,
/// quantization and GEMM. The policy itself ([`forward_on`], [`apply_on`], [`backward_on`]) is
/// written once over these, so every device quantizes the same operands the same way.
pub trait SiteKernels {
    /// A borrowed tensor.
    type Buf: ?Sized;
    /// A tensor the kernels return.
    type Owned: Borrow<Self::Buf> + BorrowMut<Self::Buf>;
    /// Where the forward's activation quantization adds its saturation/underflow counts: a
    /// slot (three counts) per run ([`CountSlots`]).
    type Counts: ?Sized;
    type Error;

    /// A copy of the first `len` values.
    fn copy(&self, x: &Self::Buf, len: usize) -> Result<Self::Owned, Self::Error>;
    /// The first `len` values rounded to BF16 (RNE).
    fn round_bf16(&self, x: &Self::Buf, len: usize) -> Result<Self::Owned, Self::Error>;
    /// Fake quantization (quantize, then dequantize) of each of `shape`'s blocks as the CPU
    /// quantizes one tensor; `counts` slots divide the blocks evenly (`Rows` only).
    fn quantize(
        &self,
        kind: SiteQuant,
        x: &Self::Buf,
        shape: Blocks,
        fmt: &QuantFormat,
        counts: Option<CountSlots<'_, Self::Counts>>,
    ) -> Result<Self::Owned, Self::Error>;
    /// Row-major `c[r, cc] = a[r, inner] · b[inner, cc]` (`+=` when `accumulate`) for `batch`
    /// triples back to back; each operand stored as itself or, when its flag says so, as its
    /// transpose; `operands` says what values they hold.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        a: (&Self::Buf, bool),
        b: (&Self::Buf, bool),
        c: &mut Self::Buf,
        dims: (usize, usize, usize),
        batch: usize,
        accumulate: bool,
        operands: Operands,
    ) -> Result<(), Self::Error>;
    /// [`SiteKernels::quantize`] of `Rows` of `x`'s BF16 rounding, the rounding itself not
    /// kept: a device whose quantizer rounds each value as it loads makes no rounded tensor.
    fn quantize_rounding(
        &self,
        x: &Self::Buf,
        shape: Blocks,
        fmt: &QuantFormat,
        counts: Option<CountSlots<'_, Self::Counts>>,
    ) -> Result<Self::Owned, Self::Error> {
        let rounded = self.round_bf16(x, shape.rows * shape.cols * shape.batch)?;
        self.quantize(SiteQuant::Rows, rounded.borrow(), shape, fmt, counts)
    }
    /// [`SiteKernels::quantize`] of `Rows` of what `reads` says, written into `dst` from `at`
    /// on rather than into a tensor of its own: a device builds the GEMM operand of several plan
    /// groups in place.
    #[allow(clippy::too_many_arguments)]
    fn quantize_rows_to(
        &self,
        x: &Self::Buf,
        reads: Reads,
        shape: Blocks,
        fmt: &QuantFormat,
        counts: Option<CountSlots<'_, Self::Counts>>,
        dst: &mut Self::Buf,
        at: usize,
    ) -> Result<(), Self::Error> {
        let q = match reads {
            Reads::Input => self.quantize(SiteQuant::Rows, x, shape, fmt, counts)?,
            Reads::Bf16Rounding => self.quantize_rounding(x, shape, fmt, counts)?,
        };
        let len = shape.rows * shape.cols * shape.batch;
        self.place(dst, at, (q.borrow(), 0), len)
    }
    /// Set every value to zero.
    fn fill_zero(&self, c: &mut Self::Buf) -> Result<(), Self::Error>;
    /// A tensor of `len` values for ops to write in full.
    fn alloc(&self, len: usize) -> Result<Self::Owned, Self::Error>;
    /// `f` of values `from..from + len` of `x` as a tensor of their own, while `f` runs: a
    /// view of them (no copy) where the device can make one.
    fn with_range<R>(
        &self,
        x: &Self::Buf,
        from: usize,
        len: usize,
        f: impl FnOnce(&Self::Buf) -> Result<R, Self::Error>,
    ) -> Result<R, Self::Error>;
    /// Values `from..from + len` of `src = (buf, from)` written into `dst` from `at` on.
    fn place(
        &self,
        dst: &mut Self::Buf,
        at: usize,
        src: (&Self::Buf, usize),
        len: usize,
    ) -> Result<(), Self::Error>;
    /// Whether [`SiteKernels::gemm`] rounds operands it is told hold BF16 values
    /// ([`Operands::Bf16`]) to BF16 itself, as a tensor-core GEMM that reads them as BF16 does.
    /// Then a pass that keeps nothing for a backward ([`apply_on`]) gives a BF16 site's input
    /// to the GEMM unrounded, and a backward whose GEMMs both round gives them dy unrounded
    /// where no group quantizes it: rounding twice is rounding once, so the products are the
    /// same.
    fn gemm_rounds_to_bf16(&self) -> bool {
        false
    }
}

/// What a quantization reads ([`SiteKernels::quantize_rows_to`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// The input as it is.
    Input,
    /// The input's BF16 rounding, not kept ([`SiteKernels::quantize_rounding`]).
    Bf16Rounding,
}

/// The runs of one site plan among the runs a device steps at once: blocks `blocks` of each of
/// the site's tensors (a run owns `batch / runs` consecutive blocks of a stacked weight).
pub struct PlanGroup<'p> {
    pub plan: &'p SitePlan,
    pub blocks: Range<usize>,
}

/// `plans` (one per run, or one for every run) as groups of consecutive runs that compute alike
/// ([`computes_as`]) over a site of `batch` blocks.
pub fn plan_groups(plans: &[SitePlan], batch: usize) -> Vec<PlanGroup<'_>> {
    groups_by(plans, batch, computes_as)
}

/// [`plan_groups`] for a pass that keeps nothing for a backward ([`apply_on`]): consecutive runs
/// whose forwards compute alike ([`forwards_as`]) are one group, so their inputs go through one
/// quantization whatever their backward modes.
fn forward_groups(plans: &[SitePlan], batch: usize) -> Vec<PlanGroup<'_>> {
    groups_by(plans, batch, forwards_as)
}

/// Consecutive runs of `plans` over a site of `batch` blocks, grouped while `alike` holds
/// between a group's first plan and the next.
fn groups_by(
    plans: &[SitePlan],
    batch: usize,
    alike: fn(&SitePlan, &SitePlan) -> bool,
) -> Vec<PlanGroup<'_>> {
    assert!(
        !plans.is_empty() && batch.is_multiple_of(plans.len()),
        "{} site plans for a stack of {batch} weights: one per run, or one for all",
        plans.len()
    );
    let per_run = batch / plans.len();
    let mut groups: Vec<PlanGroup<'_>> = Vec::new();
    for (r, p) in plans.iter().enumerate() {
        let blocks = r * per_run..(r + 1) * per_run;
        match groups.last_mut() {
            Some(g) if alike(g.plan, p) => g.blocks.end = blocks.end,
            _ => groups.push(PlanGroup { plan: p, blocks }),
        }
    }
    groups
}

/// The forward's GEMM input: the activation quantized per the site's activation format, and its
/// BF16 rounding where the backward may need it (`None` for FP32 and BF16 sites, whose operand
/// is their input or its rounding).
type Quantized<K> = (
    Option<<K as SiteKernels>::Owned>,
    Option<<K as SiteKernels>::Owned>,
);

/// `x` quantized per `plan`'s activation format; with its BF16 rounding where `keep` asks for
/// what a backward needs and the backward mode reads the rounding ([`keeps_rounding`]).
fn quantized_input<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    x: &K::Buf,
    shape: Blocks,
    counts: Option<CountSlots<'_, K::Counts>>,
    keep: bool,
) -> Result<Quantized<K>, K::Error> {
    let Some(fmt) = plan.activation_format() else {
        return Ok((None, None));
    };
    let x_hp = rounded_input(k, plan, x, shape, keep)?;
    let x_q = match (&x_hp, reads(&fmt)) {
        (Some(x_hp), _) => k.quantize(SiteQuant::Rows, x_hp.borrow(), shape, &fmt, counts)?,
        (None, Reads::Input) => k.quantize(SiteQuant::Rows, x, shape, &fmt, counts)?,
        (None, Reads::Bf16Rounding) => k.quantize_rounding(x, shape, &fmt, counts)?,
    };
    Ok((x_hp, Some(x_q)))
}

/// What a site of format `fmt` quantizes from its input: a BF16 site's operand is its BF16
/// rounding, so it quantizes the input itself (and counts saturation against the FP32 input);
/// other formats quantize the BF16 rounding of the input.
fn reads(fmt: &QuantFormat) -> Reads {
    match fmt {
        QuantFormat::Bf16 => Reads::Input,
        _ => Reads::Bf16Rounding,
    }
}

/// Whether the backward reads the BF16 rounding of a quantizing site's input: the high-precision
/// wgrad operand, and the `Quantized` mode's column quantization of it (the `Dequantized` mode
/// rounds the quantized input instead).
fn keeps_rounding(plan: &SitePlan) -> bool {
    plan.backward != BackwardMode::Dequantized
}

/// The BF16 rounding of `x` where a training forward (`keep`) of a site that quantizes it keeps
/// it for the backward ([`keeps_rounding`]); otherwise the quantizer reads the rounding as it
/// loads ([`SiteKernels::quantize_rounding`]).
fn rounded_input<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    x: &K::Buf,
    shape: Blocks,
    keep: bool,
) -> Result<Option<K::Owned>, K::Error> {
    match plan.activation_format() {
        Some(fmt) if keep && reads(&fmt) == Reads::Bf16Rounding && keeps_rounding(plan) => k
            .round_bf16(x, shape.rows * shape.cols * shape.batch)
            .map(Some),
        _ => Ok(None),
    }
}

/// The step [`forward_on`] and [`apply_on`] share: `x` quantized per the site's activation
/// format and multiplied by `w`'s forward operand into `y`. Returns the quantized input and,
/// where `keep` asks for what a backward needs, its BF16 rounding ([`Quantized`]).
#[allow(clippy::too_many_arguments)]
fn multiply<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    x: &K::Buf,
    shape: Blocks,
    w: &SiteWeight<'_, K::Buf>,
    y: &mut K::Buf,
    counts: Option<CountSlots<'_, K::Counts>>,
    keep: bool,
) -> Result<Quantized<K>, K::Error> {
    let (x_hp, x_q) = quantized_input(k, plan, x, shape, counts, keep)?;
    let input = x_q.as_ref().map_or(x, Borrow::borrow);
    let dims = (shape.rows, w.in_dim, w.out_dim);
    let operands = forward_operands(plan);
    k.gemm(
        (input, false),
        (w.fwd, true),
        y,
        dims,
        w.batch,
        false,
        operands,
    )?;
    Ok((x_hp, x_q))
}

/// Where the wgrad operand the backward mode asks for comes from.
enum WgradFrom<O> {
    /// A tensor of its own.
    Own(O),
    /// The forward's quantized input (a BF16 site's rounding).
    Quantized,
    /// The input itself (an FP32 site).
    Input,
}

/// The wgrad operand the backward mode asks for, from the forward's BF16 rounding of the input
/// and its quantization (`x_q`, as [`quantized_input`] made them for `shape`).
fn wgrad_from<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    x_hp: Option<K::Owned>,
    x_q: Option<&K::Buf>,
    shape: Blocks,
) -> Result<WgradFrom<K::Owned>, K::Error> {
    let len = shape.rows * shape.cols * shape.batch;
    // An FP32 site keeps its input; a BF16 site its rounding, whatever the backward mode.
    let fmt = match plan.activation_format() {
        None => return Ok(WgradFrom::Input),
        Some(QuantFormat::Bf16) => return Ok(WgradFrom::Quantized),
        Some(fmt) => fmt,
    };
    let x_q = x_q.expect("a site with an activation format quantizes its input");
    let kept = || x_hp.expect("kept by a training forward (`keeps_rounding`)");
    match plan.backward {
        BackwardMode::HighPrecision => Ok(WgradFrom::Own(kept())),
        BackwardMode::Dequantized => k.round_bf16(x_q, len).map(WgradFrom::Own),
        BackwardMode::Quantized if shape.rows == 0 => Ok(WgradFrom::Own(kept())),
        BackwardMode::Quantized => k
            .quantize(SiteQuant::ColsPadded, kept().borrow(), shape, &fmt, None)
            .map(WgradFrom::Own),
    }
}

/// [`wgrad_from`] as a tensor; `None` for the input itself (FP32 sites).
fn wgrad_operand<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    (x_hp, x_q): Quantized<K>,
    shape: Blocks,
) -> Result<Option<K::Owned>, K::Error> {
    Ok(
        match wgrad_from(k, plan, x_hp, x_q.as_ref().map(Borrow::borrow), shape)? {
            WgradFrom::Own(o) => Some(o),
            WgradFrom::Quantized => x_q,
            WgradFrom::Input => None,
        },
    )
}

/// The linear forward on a device: `y[n, m] = x[n, k] · Wᵀ` per block of `w`, with `x`
/// quantized per the site's activation format. Returns the wgrad operand the backward mode asks
/// for (`x_bwd`). `plans` holds the site's plan in each run the device steps (a run's blocks are
/// consecutive), or one plan for all; `counts` gets each run's activation counts, under its plan.
pub fn forward_on<K: SiteKernels>(
    k: &K,
    plans: &[SitePlan],
    x: &K::Buf,
    n: usize,
    w: &SiteWeight<'_, K::Buf>,
    y: &mut K::Buf,
    mut counts: Option<RunCounts<'_, K::Counts>>,
) -> Result<K::Owned, K::Error> {
    let groups = plan_groups(plans, w.batch);
    if groups.len() > 1 && n > 0 {
        let kept = multiply_groups(k, &groups, x, n, w, y, true, counts)?;
        return Ok(kept.expect("asked for"));
    }
    let plan = groups[0].plan;
    let shape = Blocks {
        rows: n,
        cols: w.in_dim,
        batch: w.batch,
    };
    let slots = counts.as_mut().map(|c| c.slots(&(0..w.batch), w.batch));
    let q = multiply(k, plan, x, shape, w, y, slots, true)?;
    match wgrad_operand(k, plan, q, shape)? {
        Some(kept) => Ok(kept),
        None => k.copy(x, n * w.in_dim * w.batch),
    }
}

/// [`multiply`] over several plans: each group's rows quantized per its plan into one operand,
/// then one GEMM for every group. Returns (when `keep`) the wgrad operand, each group's as its
/// backward mode asks.
#[allow(clippy::too_many_arguments)]
fn multiply_groups<K: SiteKernels>(
    k: &K,
    groups: &[PlanGroup<'_>],
    x: &K::Buf,
    n: usize,
    w: &SiteWeight<'_, K::Buf>,
    y: &mut K::Buf,
    keep: bool,
    mut counts: Option<RunCounts<'_, K::Counts>>,
) -> Result<Option<K::Owned>, K::Error> {
    let per = n * w.in_dim;
    let len = per * w.batch;
    let operands = Operands::all(groups, forward_operands);
    let mut operand = k.alloc(len)?;
    let mut kept = if keep { Some(k.alloc(len)?) } else { None };
    for g in groups {
        let (at, glen) = (g.blocks.start * per, g.blocks.len() * per);
        if !keep && rounded_by_gemm(k, g.plan, operands) {
            k.place(operand.borrow_mut(), at, (x, at), glen)?;
            continue;
        }
        let shape = Blocks {
            rows: n,
            cols: w.in_dim,
            batch: g.blocks.len(),
        };
        let slots = counts.as_mut().map(|c| c.slots(&g.blocks, w.batch));
        k.with_range(x, at, glen, |xg| {
            // Each group quantizes straight into its rows of the operand.
            let Some(fmt) = g.plan.activation_format() else {
                k.place(operand.borrow_mut(), at, (xg, 0), glen)?;
                if let Some(kept) = kept.as_mut() {
                    k.place(kept.borrow_mut(), at, (xg, 0), glen)?;
                }
                return Ok(());
            };
            let x_hp = rounded_input(k, g.plan, xg, shape, keep)?;
            let (src, what) = match &x_hp {
                Some(x_hp) => (x_hp.borrow(), Reads::Input),
                None => (xg, reads(&fmt)),
            };
            k.quantize_rows_to(src, what, shape, &fmt, slots, operand.borrow_mut(), at)?;
            let Some(kept) = kept.as_mut() else {
                return Ok(());
            };
            k.with_range(operand.borrow(), at, glen, |x_q| {
                let from = wgrad_from(k, g.plan, x_hp, Some(x_q), shape)?;
                let src = match &from {
                    WgradFrom::Own(o) => o.borrow(),
                    WgradFrom::Quantized => x_q,
                    WgradFrom::Input => xg,
                };
                k.place(kept.borrow_mut(), at, (src, 0), glen)
            })
        })?;
    }
    let dims = (n, w.in_dim, w.out_dim);
    k.gemm(
        (operand.borrow(), false),
        (w.fwd, true),
        y,
        dims,
        w.batch,
        false,
        operands,
    )?;
    Ok(kept)
}

/// Whether a pass that keeps nothing for a backward may give `plan`'s BF16 input to a GEMM of
/// `operands` unrounded, the GEMM rounding it ([`SiteKernels::gemm_rounds_to_bf16`]).
fn rounded_by_gemm<K: SiteKernels>(k: &K, plan: &SitePlan, operands: Operands) -> bool {
    operands == Operands::Bf16
        && matches!(plan.activation_format(), Some(QuantFormat::Bf16))
        && k.gemm_rounds_to_bf16()
}

/// [`forward_on`] without what a backward needs (an inference pass: decode, the reference
/// forward): the same quantization and GEMM.
pub fn apply_on<K: SiteKernels>(
    k: &K,
    plans: &[SitePlan],
    x: &K::Buf,
    n: usize,
    w: &SiteWeight<'_, K::Buf>,
    y: &mut K::Buf,
) -> Result<(), K::Error> {
    let groups = forward_groups(plans, w.batch);
    let operands = Operands::all(&groups, forward_operands);
    if groups.iter().all(|g| rounded_by_gemm(k, g.plan, operands)) {
        // Every run's input goes to the GEMM as it is.
        let dims = (n, w.in_dim, w.out_dim);
        return k.gemm((x, false), (w.fwd, true), y, dims, w.batch, false, operands);
    }
    if groups.len() > 1 && n > 0 {
        return multiply_groups(k, &groups, x, n, w, y, false, None).map(|_| ());
    }
    let shape = Blocks {
        rows: n,
        cols: w.in_dim,
        batch: w.batch,
    };
    multiply(k, groups[0].plan, x, shape, w, y, None, false).map(|_| ())
}

/// dy's dgrad and wgrad operands as the site's backward mode makes them (`None`: dy itself; the
/// wgrad one `None` where it is the dgrad one).
type DyOperands<K> = (
    Option<<K as SiteKernels>::Owned>,
    Option<<K as SiteKernels>::Owned>,
);

/// `rounded_by_gemms`: both GEMMs round their operands to BF16 themselves, so dy goes to them
/// unrounded where the mode does not quantize it (rounding twice is rounding once).
fn dy_operands<K: SiteKernels>(
    k: &K,
    plan: &SitePlan,
    dy: &K::Buf,
    shape: Blocks,
    rounded_by_gemms: bool,
) -> Result<DyOperands<K>, K::Error> {
    let Some(fmt) = plan.activation_format() else {
        return Ok((None, None));
    };
    if rounded_by_gemms && !dy_quantized(plan) {
        return Ok((None, None));
    }
    let dy_hp = k.round_bf16(dy, shape.rows * shape.cols * shape.batch)?;
    if dy_quantized(plan) {
        // dgrad contracts over m (row blocks of dy); wgrad over n (column blocks of dy).
        let d = k.quantize(SiteQuant::RowsPadded, dy_hp.borrow(), shape, &fmt, None)?;
        let wq = k.quantize(SiteQuant::ColsPadded, dy_hp.borrow(), shape, &fmt, None)?;
        Ok((Some(d), Some(wq)))
    } else {
        Ok((Some(dy_hp), None))
    }
}

/// The linear backward on a device: `dx = dy · W` (written when `dx` is given) and
/// `dW += dyᵀ · x_bwd` (accumulated) per block of `w`, dy rounded and quantized as the site's
/// backward mode says (`plans` as [`forward_on`] takes them).
#[allow(clippy::too_many_arguments)]
pub fn backward_on<K: SiteKernels>(
    k: &K,
    plans: &[SitePlan],
    x_bwd: &K::Buf,
    n: usize,
    w: &SiteWeight<'_, K::Buf>,
    dy: &K::Buf,
    dx: Option<&mut K::Buf>,
    dw: &mut K::Buf,
) -> Result<(), K::Error> {
    let (kd, m, batch) = (w.in_dim, w.out_dim, w.batch);
    if n == 0 {
        return dx.map_or(Ok(()), |dx| k.fill_zero(dx));
    }
    let groups = plan_groups(plans, batch);
    let (dgrad, wgrad) = (
        Operands::all(&groups, dgrad_operands),
        Operands::all(&groups, wgrad_operands),
    );
    let rounded_by_gemms = k.gemm_rounds_to_bf16() && dgrad == wgrad && wgrad == Operands::Bf16;
    let (own_d, own_w) = match &groups[..] {
        [g] => {
            let shape = Blocks {
                rows: n,
                cols: m,
                batch,
            };
            dy_operands(k, g.plan, dy, shape, rounded_by_gemms)?
        }
        // No group quantizes dy and the GEMMs round it: every run's dy as it is.
        _ if rounded_by_gemms && !groups.iter().any(|g| dy_quantized(g.plan)) => (None, None),
        _ => {
            // Each group's operands into a tensor of every run's rows; the wgrad ones into a
            // second where some group quantizes dy, whose wgrad operand is then its own.
            let per = n * m;
            let mut d_all = k.alloc(per * batch)?;
            let mut w_all = match groups.iter().any(|g| dy_quantized(g.plan)) {
                true => Some(k.alloc(per * batch)?),
                false => None,
            };
            for g in &groups {
                let (at, glen) = (g.blocks.start * per, g.blocks.len() * per);
                let shape = Blocks {
                    rows: n,
                    cols: m,
                    batch: g.blocks.len(),
                };
                k.with_range(dy, at, glen, |dyg| {
                    let (d, wq) = dy_operands(k, g.plan, dyg, shape, rounded_by_gemms)?;
                    let d = d.as_ref().map_or(dyg, Borrow::borrow);
                    let wq = wq.as_ref().map_or(d, Borrow::borrow);
                    k.place(d_all.borrow_mut(), at, (d, 0), glen)?;
                    match w_all.as_mut() {
                        Some(w_all) => k.place(w_all.borrow_mut(), at, (wq, 0), glen),
                        None => Ok(()),
                    }
                })?;
            }
            (Some(d_all), w_all)
        }
    };
    let dy_d = own_d.as_ref().map_or(dy, Borrow::borrow);
    let dy_w = own_w.as_ref().map_or(dy_d, Borrow::borrow);
    if let Some(dx) = dx {
        k.gemm(
            (dy_d, false),
            (w.bwd, false),
            dx,
            (n, m, kd),
            batch,
            false,
            dgrad,
        )?;
    }
    k.gemm(
        (dy_w, true),
        (x_bwd, false),
        dw,
        (m, n, kd),
        batch,
        true,
        wgrad,
    )
}

/// The host's kernels: `crate::formats` and the CPU GEMM, each tensor a single block.
pub struct HostKernels;

/// Whether a site computes the same under plans `a` and `b`: the same plan, or both FP32 or both
/// BF16, which read nothing else (their backward takes the input or its rounding and dy's
/// rounding whatever the mode, and their dgrad weight is the forward one; see
/// [`dgrad_operand`]). Recipes keep BF16 sites under their own backward mode, so a batch of
/// several recipes computes its BF16 sites as one group.
pub fn computes_as(a: &SitePlan, b: &SitePlan) -> bool {
    a == b
        || (a.precision == b.precision && matches!(a.precision, Precision::Fp32 | Precision::Bf16))
}

/// Whether a site's forward computes the same under plans `a` and `b`: the same precision and
/// activation format (the second-level scale, its shards and the MXFP8 scale rule); the backward
/// mode changes only what a training forward keeps. A run's weights are prepared under its own
/// plan, so only the activation's quantization is shared. Recipes that differ only in their
/// backward (mxfp8, mxfp8-hp, mxfp8-dq) quantize a rollout's activations as one group.
pub fn forwards_as(a: &SitePlan, b: &SitePlan) -> bool {
    computes_as(a, b)
        || (a.precision == b.precision && a.activation_format() == b.activation_format())
}

impl SiteKernels for HostKernels {
    type Buf = [f32];
    type Owned = Vec<f32>;
    type Counts = [QuantStats];
    type Error = std::convert::Infallible;

    fn copy(&self, x: &[f32], len: usize) -> Result<Vec<f32>, Self::Error> {
        Ok(x[..len].to_vec())
    }

    fn round_bf16(&self, x: &[f32], len: usize) -> Result<Vec<f32>, Self::Error> {
        Ok(bf16_vec(&x[..len]))
    }

    fn quantize(
        &self,
        kind: SiteQuant,
        x: &[f32],
        Blocks { rows, cols, batch }: Blocks,
        fmt: &QuantFormat,
        counts: Option<CountSlots<'_, [QuantStats]>>,
    ) -> Result<Vec<f32>, Self::Error> {
        assert_eq!(batch, 1, "the host quantizes one tensor at a time");
        let x = &x[..rows * cols];
        Ok(match kind {
            _ if rows == 0 => Vec::new(),
            SiteQuant::Rows => {
                let mut out = vec![0.0f32; rows * cols];
                let stats = fake_quantize(x, rows, cols, fmt, Axis::Row, &mut out)
                    .expect("site shape checked by check_site");
                if let Some(c) = counts {
                    assert_eq!(c.slots, 1, "one tensor, one count slot");
                    c.counts[c.first] = c.counts[c.first].merge(stats);
                }
                out
            }
            SiteQuant::RowsPadded => fake_quantize_row_padded(x, rows, cols, fmt),
            SiteQuant::ColsPadded => fake_quantize_col_padded(x, rows, cols, fmt),
        })
    }

    fn gemm(
        &self,
        (a, a_t): (&[f32], bool),
        (b, b_t): (&[f32], bool),
        c: &mut [f32],
        (r, inner, cc): (usize, usize, usize),
        batch: usize,
        accumulate: bool,
        _: Operands,
    ) -> Result<(), Self::Error> {
        // FP32 whatever the operands hold: the reference every device is held against.
        assert_eq!(batch, 1, "the host multiplies one pair at a time");
        fn stored(m: &[f32], rows: usize, cols: usize, t: bool) -> MatRef<'_> {
            if t {
                MatRef::new(&m[..rows * cols], cols, rows).t()
            } else {
                MatRef::new(&m[..rows * cols], rows, cols)
            }
        }
        gemm(
            stored(a, r, inner, a_t),
            stored(b, inner, cc, b_t),
            &mut c[..r * cc],
            accumulate,
        );
        Ok(())
    }

    fn fill_zero(&self, c: &mut [f32]) -> Result<(), Self::Error> {
        c.fill(0.0);
        Ok(())
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>, Self::Error> {
        Ok(vec![0.0; len])
    }

    fn with_range<R>(
        &self,
        x: &[f32],
        from: usize,
        len: usize,
        f: impl FnOnce(&[f32]) -> Result<R, Self::Error>,
    ) -> Result<R, Self::Error> {
        f(&x[from..from + len])
    }

    fn place(
        &self,
        dst: &mut [f32],
        at: usize,
        (src, from): (&[f32], usize),
        len: usize,
    ) -> Result<(), Self::Error> {
        dst[at..at + len].copy_from_slice(&src[from..from + len]);
        Ok(())
    }
}

impl PreparedWeight {
    /// The operands as the policy reads them.
    fn site(&self) -> SiteWeight<'_, [f32]> {
        SiteWeight {
            fwd: &self.w_fwd,
            bwd: self.w_bwd(),
            out_dim: self.out_dim,
            in_dim: self.in_dim,
            batch: 1,
        }
    }
}

fn infallible<T>(r: Result<T, std::convert::Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => match e {},
    }
}

/// `y[n, m] = x[n, k] · Wᵀ` on the host; returns the cache the backward needs.
pub fn forward(
    plan: &SitePlan,
    x: &[f32],
    n: usize,
    w: &PreparedWeight,
    y: &mut [f32],
) -> LinearCache {
    assert_eq!(x.len(), n * w.in_dim);
    let mut stats = [QuantStats::default()];
    let counts = RunCounts {
        counts: &mut stats[..],
        runs: 1,
    };
    let x_bwd = infallible(forward_on(
        &HostKernels,
        std::slice::from_ref(plan),
        x,
        n,
        &w.site(),
        y,
        Some(counts),
    ));
    LinearCache {
        x_bwd,
        n,
        stats: stats[0],
    }
}

/// Backward on the host: `dx = dy · W` (written to `dx` when given) and `dW += dyᵀ · x`
/// (accumulated).
pub fn backward(
    plan: &SitePlan,
    cache: &LinearCache,
    w: &PreparedWeight,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
) {
    assert_eq!(dy.len(), cache.n * w.out_dim);
    let site = w.site();
    infallible(backward_on(
        &HostKernels,
        std::slice::from_ref(plan),
        &cache.x_bwd,
        cache.n,
        &site,
        dy,
        dx,
        dw,
    ));
}

/// Row-wise fake quantization of `[r, c]`, padding `c` with zero columns up to the block
/// multiple.
fn fake_quantize_row_padded(x: &[f32], r: usize, c: usize, fmt: &QuantFormat) -> Vec<f32> {
    let m = fmt.required_multiple();
    let cp = c.div_ceil(m) * m;
    let mut out = vec![0.0f32; r * cp];
    if cp == c {
        fake_quantize(x, r, c, fmt, Axis::Row, &mut out)
            .expect("blocked dimension is a multiple of the block");
        return out;
    }
    let mut padded = vec![0.0f32; r * cp];
    for i in 0..r {
        padded[i * cp..i * cp + c].copy_from_slice(&x[i * c..(i + 1) * c]);
    }
    fake_quantize(&padded, r, cp, fmt, Axis::Row, &mut out)
        .expect("padded to a multiple of the block");
    (0..r)
        .flat_map(|i| out[i * cp..i * cp + c].to_vec())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.731).sin() * if i % 29 == 0 { 8.0 } else { 1.0 })
            .collect()
    }

    fn plan(p: Precision, b: BackwardMode) -> SitePlan {
        SitePlan {
            precision: p,
            backward: b,
            ..SitePlan::FP32
        }
    }

    #[test]
    fn fp32_site_is_an_exact_matmul_and_its_gradients_are_exact() {
        let (n, k, m) = (5, 32, 3);
        let (x, w) = (data(n * k, 0.0), data(m * k, 1.0));
        let p = prepare_weight(&SitePlan::FP32, &w, m, k);
        let mut y = vec![0.0; n * m];
        let c = forward(&SitePlan::FP32, &x, n, &p, &mut y);
        for i in 0..n {
            for j in 0..m {
                let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
                assert!((y[i * m + j] - want).abs() < 1e-4);
            }
        }
        let dy = data(n * m, 2.0);
        let (mut dx, mut dw) = (vec![0.0; n * k], vec![0.0; m * k]);
        backward(&SitePlan::FP32, &c, &p, &dy, Some(&mut dx), &mut dw);
        let want_dx: f32 = (0..m).map(|j| dy[j] * w[j * k]).sum();
        let want_dw: f32 = (0..n).map(|i| dy[i * m] * x[i * k]).sum();
        assert!((dx[0] - want_dx).abs() < 1e-4 && (dw[0] - want_dw).abs() < 1e-4);
    }

    #[test]
    fn backward_modes_use_the_operands_they_promise() {
        let (n, k, m) = (40, 64, 32); // 40 tokens: not a multiple of 32, so the column copies pad
        let (x, w) = (data(n * k, 0.0), data(m * k, 1.0));
        let fwd_q = |p: &SitePlan| {
            let pw = prepare_weight(p, &w, m, k);
            let mut y = vec![0.0; n * m];
            let c = forward(p, &x, n, &pw, &mut y);
            (pw, c)
        };
        for prec in [Precision::Mxfp8, Precision::Nvfp4] {
            let hp = plan(prec, BackwardMode::HighPrecision);
            let dq = plan(prec, BackwardMode::Dequantized);
            let qz = plan(prec, BackwardMode::Quantized);
            let (pw_hp, c_hp) = fwd_q(&hp);
            let (pw_dq, c_dq) = fwd_q(&dq);
            let (pw_qz, c_qz) = fwd_q(&qz);
            // Forward operands are identical whatever the backward mode.
            assert_eq!(pw_hp.w_fwd, pw_dq.w_fwd);
            assert_eq!(pw_hp.digest, pw_qz.digest);
            // High precision: BF16 originals.
            assert_eq!(pw_hp.w_bwd(), bf16_vec(&w));
            assert_eq!(c_hp.x_bwd, bf16_vec(&x));
            // Dequantized: BF16 of exactly what the forward used.
            assert_eq!(pw_dq.w_bwd(), bf16_vec(&pw_dq.w_fwd));
            let mut xq = vec![0.0; n * k];
            fake_quantize(
                &bf16_vec(&x),
                n,
                k,
                &hp.activation_format().unwrap(),
                Axis::Row,
                &mut xq,
            )
            .unwrap();
            assert_eq!(c_dq.x_bwd, bf16_vec(&xq));
            // Quantized: fresh column-wise copies of the BF16 originals (blocks along the contraction).
            let mut col = vec![0.0; m * k];
            fake_quantize(
                &bf16_vec(&w),
                m,
                k,
                &qz.weight_format().unwrap(),
                Axis::Col,
                &mut col,
            )
            .unwrap();
            assert!(
                pw_qz.w_bwd() == col,
                "{prec:?}: dgrad weight is not the column-wise quantization"
            );
            let mut xpad = bf16_vec(&x);
            xpad.resize(64 * k, 0.0); // 40 tokens padded to 64 (a multiple of 16 and 32)
            let mut xcol = vec![0.0; 64 * k];
            fake_quantize(
                &xpad,
                64,
                k,
                &qz.activation_format().unwrap(),
                Axis::Col,
                &mut xcol,
            )
            .unwrap();
            assert!(
                c_qz.x_bwd[..] == xcol[..n * k],
                "{prec:?}: wgrad activation is not the padded column-wise quantization"
            );
            // All three give a gradient close to the FP32 one.
            let dy = data(n * m, 3.0);
            let pf = prepare_weight(&SitePlan::FP32, &w, m, k);
            let mut y = vec![0.0; n * m];
            let cf = forward(&SitePlan::FP32, &x, n, &pf, &mut y);
            let (mut dx_f, mut dw_f) = (vec![0.0; n * k], vec![0.0; m * k]);
            backward(&SitePlan::FP32, &cf, &pf, &dy, Some(&mut dx_f), &mut dw_f);
            for (p, pw, c) in [
                (hp, &pw_hp, &c_hp),
                (dq, &pw_dq, &c_dq),
                (qz, &pw_qz, &c_qz),
            ] {
                let (mut dx, mut dw) = (vec![0.0; n * k], vec![0.0; m * k]);
                backward(&p, c, pw, &dy, Some(&mut dx), &mut dw);
                let rel = |a: &[f32], b: &[f32]| {
                    let num: f32 = a.iter().zip(b).map(|(u, v)| (u - v) * (u - v)).sum();
                    (num / b.iter().map(|v| v * v).sum::<f32>()).sqrt()
                };
                let tol = if prec == Precision::Nvfp4 { 0.25 } else { 0.08 };
                assert!(
                    rel(&dx, &dx_f) < tol,
                    "{prec:?} {:?} dx rel err {}",
                    p.backward,
                    rel(&dx, &dx_f)
                );
                assert!(
                    rel(&dw, &dw_f) < tol,
                    "{prec:?} {:?} dw rel err {}",
                    p.backward,
                    rel(&dw, &dw_f)
                );
            }
        }
    }

    #[test]
    fn bf16_site_rounds_operands() {
        let (n, k, m) = (2, 32, 2);
        let (x, w) = (data(n * k, 0.5), data(m * k, 1.5));
        let pw = prepare_weight(&SitePlan::BF16, &w, m, k);
        assert_eq!(pw.w_fwd, bf16_vec(&w));
        let mut y = vec![0.0; n * m];
        let c = forward(&SitePlan::BF16, &x, n, &pw, &mut y);
        assert_eq!(c.x_bwd, bf16_vec(&x));
    }

    #[test]
    fn digests_change_with_the_quantizer() {
        let (m, k) = (4, 64);
        let w = data(m * k, 0.0);
        let a = prepare_weight(&plan(Precision::Mxfp8, BackwardMode::Quantized), &w, m, k);
        let b = prepare_weight(&plan(Precision::Nvfp4, BackwardMode::Quantized), &w, m, k);
        let a2 = prepare_weight(&plan(Precision::Mxfp8, BackwardMode::Dequantized), &w, m, k);
        assert_ne!(a.digest, b.digest);
        assert_eq!(a.digest, a2.digest);
        assert!(check_site(&plan(Precision::Mxfp8, BackwardMode::Quantized), 8, 48).is_err());
    }

    /// One stored (and uploaded) operand where the dgrad operand is the forward one: a BF16 site
    /// (BF16 values quantize to themselves) and an MXFP8 site with the dequantized backward (E4M3
    /// values times a power of two are BF16-exact); two where they differ (the high-precision
    /// backward keeps the BF16 originals).
    #[test]
    fn the_dgrad_operand_is_shared_exactly_when_it_equals_the_forward_one() {
        let (m, k) = (4, 64);
        let w = data(m * k, 0.0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (p, b, shared) in [
            (Precision::Bf16, BackwardMode::HighPrecision, true),
            (Precision::Mxfp8, BackwardMode::Dequantized, true),
            (Precision::Mxfp8, BackwardMode::HighPrecision, false),
        ] {
            let pw = prepare_weight(&plan(p, b), &w, m, k);
            assert_eq!(pw.bwd_is_fwd(), shared, "{p:?} {b:?}");
            assert_eq!(bits(pw.w_bwd()) == bits(pw.w_fwd()), shared, "{p:?} {b:?}");
        }
    }

    /// The host's kernels over stacked blocks: each block quantized and multiplied alone, as a
    /// device stepping several runs does it. Its GEMMs check that operands said to hold BF16
    /// values do (or, with `gemm_rounds`, round them as a tensor-core GEMM does), and note what
    /// each was told (in call order); `roundings` counts the BF16 roundings made before them
    /// (`round_bf16`, BF16 quantization). With `loads_rounded` its quantizer reads a rounding
    /// as a device's does (`quantize_rounding`), uncounted.
    #[derive(Default)]
    struct Blocked {
        gemms: std::cell::RefCell<Vec<Operands>>,
        gemm_rounds: bool,
        roundings: std::cell::Cell<usize>,
        loads_rounded: bool,
    }

    impl SiteKernels for Blocked {
        type Buf = [f32];
        type Owned = Vec<f32>;
        type Counts = [QuantStats];
        type Error = std::convert::Infallible;

        fn copy(&self, x: &[f32], len: usize) -> Result<Vec<f32>, Self::Error> {
            HostKernels.copy(x, len)
        }
        fn round_bf16(&self, x: &[f32], len: usize) -> Result<Vec<f32>, Self::Error> {
            self.roundings.set(self.roundings.get() + 1);
            HostKernels.round_bf16(x, len)
        }
        fn quantize(
            &self,
            kind: SiteQuant,
            x: &[f32],
            Blocks { rows, cols, batch }: Blocks,
            fmt: &QuantFormat,
            mut counts: Option<CountSlots<'_, [QuantStats]>>,
        ) -> Result<Vec<f32>, Self::Error> {
            if *fmt == QuantFormat::Bf16 {
                self.roundings.set(self.roundings.get() + 1);
            }
            let one = Blocks {
                rows,
                cols,
                batch: 1,
            };
            let mut out = Vec::new();
            for b in 0..batch {
                let blk = &x[b * rows * cols..(b + 1) * rows * cols];
                let slot = counts.as_mut().map(|c| c.part(b, batch));
                let q = HostKernels.quantize(kind, blk, one, fmt, slot)?;
                assert_eq!(q.len(), rows * cols);
                out.extend(q);
            }
            Ok(out)
        }
        fn quantize_rounding(
            &self,
            x: &[f32],
            shape: Blocks,
            fmt: &QuantFormat,
            counts: Option<CountSlots<'_, [QuantStats]>>,
        ) -> Result<Vec<f32>, Self::Error> {
            let len = shape.rows * shape.cols * shape.batch;
            let rounded = match self.loads_rounded {
                true => HostKernels.round_bf16(x, len)?,
                false => self.round_bf16(x, len)?,
            };
            self.quantize(SiteQuant::Rows, &rounded, shape, fmt, counts)
        }
        fn gemm(
            &self,
            (a, a_t): (&[f32], bool),
            (b, b_t): (&[f32], bool),
            c: &mut [f32],
            (r, inner, cc): (usize, usize, usize),
            batch: usize,
            accumulate: bool,
            operands: Operands,
        ) -> Result<(), Self::Error> {
            let (la, lb, lc) = (r * inner, inner * cc, r * cc);
            let (ra, rb);
            let (a, b) = if self.gemm_rounds && operands == Operands::Bf16 {
                (ra, rb) = (bf16_vec(a), bf16_vec(b));
                (&ra[..], &rb[..])
            } else {
                (a, b)
            };
            if operands == Operands::Bf16 {
                // What a device's BF16 tensor-core GEMM relies on (see `decodes_to_bf16` for
                // the values below 2^-126).
                for (which, v) in [("a", &a[..batch * la]), ("b", &b[..batch * lb])] {
                    let off = v.iter().find(|v| {
                        round_bf16(**v).to_bits() != v.to_bits() && v.abs() >= f32::MIN_POSITIVE
                    });
                    assert!(
                        off.is_none(),
                        "operand {which} holds {off:?}, not a BF16 value"
                    );
                }
            }
            self.gemms.borrow_mut().push(operands);
            for i in 0..batch {
                HostKernels.gemm(
                    (&a[i * la..(i + 1) * la], a_t),
                    (&b[i * lb..(i + 1) * lb], b_t),
                    &mut c[i * lc..(i + 1) * lc],
                    (r, inner, cc),
                    1,
                    accumulate,
                    operands,
                )?;
            }
            Ok(())
        }
        fn fill_zero(&self, c: &mut [f32]) -> Result<(), Self::Error> {
            HostKernels.fill_zero(c)
        }
        fn alloc(&self, len: usize) -> Result<Vec<f32>, Self::Error> {
            HostKernels.alloc(len)
        }
        fn with_range<R>(
            &self,
            x: &[f32],
            from: usize,
            len: usize,
            f: impl FnOnce(&[f32]) -> Result<R, Self::Error>,
        ) -> Result<R, Self::Error> {
            HostKernels.with_range(x, from, len, f)
        }
        fn place(
            &self,
            dst: &mut [f32],
            at: usize,
            src: (&[f32], usize),
            len: usize,
        ) -> Result<(), Self::Error> {
            HostKernels.place(dst, at, src, len)
        }
        fn gemm_rounds_to_bf16(&self) -> bool {
            self.gemm_rounds
        }
    }

    /// FP32 and BF16 plans compute alike whatever else they say; a low-precision plan only as
    /// the same plan (its backward mode, and NVFP4's activation scale, change what it computes).
    #[test]
    fn only_fp32_and_bf16_plans_compute_alike_across_their_settings() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        let modes = [HighPrecision, Dequantized, Quantized];
        for p in [Precision::Fp32, Precision::Bf16] {
            for (a, b) in modes.iter().flat_map(|a| modes.iter().map(move |b| (a, b))) {
                let other = SitePlan {
                    act_scale: crate::formats::SecondScale::PerTensor,
                    shards: 2,
                    ..plan(p, *b)
                };
                assert!(computes_as(&plan(p, *a), &other), "{p:?} {a:?} {b:?}");
            }
        }
        for p in [Precision::Mxfp8, Precision::Nvfp4, Precision::Fp8Block] {
            for (a, b) in modes.iter().flat_map(|a| modes.iter().map(move |b| (a, b))) {
                assert_eq!(
                    computes_as(&plan(p, *a), &plan(p, *b)),
                    a == b,
                    "{p:?} {a:?} {b:?}"
                );
            }
        }
        let per_tensor = SitePlan {
            act_scale: crate::formats::SecondScale::PerTensor,
            ..plan(Precision::Nvfp4, HighPrecision)
        };
        assert!(!computes_as(
            &plan(Precision::Nvfp4, HighPrecision),
            &per_tensor
        ));
        assert!(!computes_as(
            &plan(Precision::Bf16, HighPrecision),
            &SitePlan::FP32
        ));
    }

    /// Runs of different plans in one stacked site (two blocks a run, like two experts): each
    /// run's output, kept wgrad operand, dx, dW and activation counts are bit for bit what a site
    /// of its plan alone computes over its blocks, whatever the runs beside it (a count in the
    /// wrong run's slot fails it). In the first batch runs 0 and 1 share a plan and the BF16 runs
    /// compute alike, so the groups are consecutive runs (4 groups of 6 runs), the FP32 and BF16
    /// groups take the no-quantizer branches and the `Quantized` one pads its odd token count;
    /// in the second no group quantizes dy.
    #[test]
    fn runs_of_different_plans_in_one_site_each_compute_as_their_plan_alone() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        // The two BF16 runs, of two backward modes, are one group.
        let quantizing = [
            plan(Precision::Nvfp4, Dequantized),
            plan(Precision::Nvfp4, Dequantized),
            plan(Precision::Mxfp8, Quantized),
            SitePlan::FP32,
            plan(Precision::Bf16, HighPrecision),
            plan(Precision::Bf16, Quantized),
        ];
        each_run_computes_as_its_plan_alone(&quantizing, 4);
        // No group quantizes dy: dgrad and wgrad read one tensor of dy's operands.
        let rounding = [
            plan(Precision::Mxfp8, HighPrecision),
            plan(Precision::Bf16, Dequantized),
            plan(Precision::Nvfp4, Dequantized),
            plan(Precision::Mxfp8, Dequantized),
        ];
        each_run_computes_as_its_plan_alone(&rounding, 4);
    }

    fn each_run_computes_as_its_plan_alone(plans: &[SitePlan], groups: usize) {
        let (n, k, m, per_run) = (5, 64, 32, 2);
        let runs = plans.len();
        let batch = runs * per_run;
        assert_eq!(plan_groups(plans, batch).len(), groups);
        let (xl, wl, yl) = (n * k, m * k, n * m);
        let x = data(batch * xl, 0.5);
        let dy = data(batch * yl, 1.5);
        let dw0 = data(batch * wl, 2.5);
        // Each block's weight prepared under its run's plan.
        let prepared: Vec<PreparedWeight> = (0..batch)
            .map(|b| prepare_weight(&plans[b / per_run], &data(wl, 3.0 + b as f32), m, k))
            .collect();
        let site = |blocks: std::ops::Range<usize>| -> (Vec<f32>, Vec<f32>) {
            let fwd = blocks
                .clone()
                .flat_map(|b| prepared[b].w_fwd().to_vec())
                .collect();
            let bwd = blocks.flat_map(|b| prepared[b].w_bwd().to_vec()).collect();
            (fwd, bwd)
        };
        // Forward and backward of blocks `blocks` under `plans`: y, x_bwd, dx, dW.
        let run = |plans: &[SitePlan], blocks: std::ops::Range<usize>| {
            let nb = blocks.len();
            let (fwd, bwd) = site(blocks.clone());
            let w = SiteWeight {
                fwd: &fwd[..],
                bwd: &bwd[..],
                out_dim: m,
                in_dim: k,
                batch: nb,
            };
            let xs = &x[blocks.start * xl..blocks.end * xl];
            let mut y = vec![0.0f32; nb * yl];
            let runs = nb / per_run;
            let mut counts = vec![QuantStats::default(); runs];
            let slots = RunCounts {
                counts: &mut counts[..],
                runs,
            };
            let k = Blocked::default();
            let kept = infallible(forward_on(&k, plans, xs, n, &w, &mut y, Some(slots)));
            let mut dx = vec![0.0f32; nb * xl];
            let mut dw = dw0[blocks.start * wl..blocks.end * wl].to_vec();
            let dys = &dy[blocks.start * yl..blocks.end * yl];
            infallible(backward_on(
                &k,
                plans,
                &kept,
                n,
                &w,
                dys,
                Some(&mut dx),
                &mut dw,
            ));
            ([y, kept, dx, dw], counts)
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (joint, joint_counts) = run(plans, 0..batch);
        for (r, p) in plans.iter().enumerate() {
            let blocks = r * per_run..(r + 1) * per_run;
            let (alone, alone_counts) = run(std::slice::from_ref(p), blocks.clone());
            assert_eq!(joint_counts[r], alone_counts[0], "run {r} ({p:?}): counts");
            let counted = p.activation_format().is_some();
            assert_eq!(
                joint_counts[r].elements > 0,
                counted,
                "run {r} ({p:?}): counted"
            );
            for (i, (what, len)) in [("y", yl), ("x_bwd", xl), ("dx", xl), ("dW", wl)]
                .into_iter()
                .enumerate()
            {
                let got = &joint[i][blocks.start * len..blocks.end * len];
                assert_eq!(bits(got), bits(&alone[i]), "run {r} ({p:?}): {what}");
            }
        }
    }

    /// The forward operands of `per_run` weights `[m, k]` a run, each prepared under its run's
    /// plan, stacked.
    fn forward_stack(plans: &[SitePlan], per_run: usize, m: usize, k: usize) -> Vec<f32> {
        (0..plans.len() * per_run)
            .flat_map(|b| {
                let p = &plans[b / per_run];
                prepare_weight(p, &data(m * k, 3.0 + b as f32), m, k)
                    .w_fwd()
                    .to_vec()
            })
            .collect()
    }

    /// An inference pass on a device whose GEMM rounds BF16 operands itself gives BF16 sites'
    /// inputs to the GEMM unrounded, and computes the same bits as rounding them first: alone,
    /// BF16 groups of two backward modes, beside an MXFP8 group (whose input is still rounded
    /// and quantized), and beside an NVFP4 group (FP32 operands: every input rounded first).
    #[test]
    fn an_inference_pass_leaves_bf16_rounding_to_a_gemm_that_rounds() {
        let (n, k, m, per_run) = (5, 64, 32, 2);
        let bf16 = plan(Precision::Bf16, BackwardMode::HighPrecision);
        let bf16_dq = plan(Precision::Bf16, BackwardMode::Dequantized);
        let mxfp8 = plan(Precision::Mxfp8, BackwardMode::Dequantized);
        let nvfp4 = plan(Precision::Nvfp4, BackwardMode::Dequantized);
        // Plans of the runs, and the BF16 roundings made before the GEMM.
        let cases: [(&[SitePlan], usize); 4] = [
            (&[bf16], 0),
            (&[bf16, bf16_dq, bf16], 0),
            (&[bf16, mxfp8, bf16_dq], 1),
            (&[bf16, nvfp4, bf16_dq], 3),
        ];
        for (plans, roundings) in cases {
            let batch = plans.len() * per_run;
            let x = data(batch * n * k, 0.5);
            let w = forward_stack(plans, per_run, m, k);
            let site = SiteWeight {
                fwd: &w[..],
                bwd: &w[..],
                out_dim: m,
                in_dim: k,
                batch,
            };
            let apply = |kernels: &dyn Fn(&mut Vec<f32>)| {
                let mut y = vec![0.0f32; batch * n * m];
                kernels(&mut y);
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let rounding = Blocked {
                gemm_rounds: true,
                ..Blocked::default()
            };
            let fast = apply(&|y| infallible(apply_on(&rounding, plans, &x, n, &site, y)));
            let each =
                apply(&|y| infallible(apply_on(&Blocked::default(), plans, &x, n, &site, y)));
            let case: Vec<_> = plans.iter().map(|p| (p.precision, p.backward)).collect();
            let differ = fast.iter().zip(&each).position(|(a, b)| a != b);
            assert_eq!(differ, None, "{case:?}: first output that differs");
            assert_eq!(rounding.roundings.get(), roundings, "{case:?}: roundings");
        }
    }

    /// An inference pass quantizes the inputs of runs whose forwards compute alike as one group,
    /// whatever their backward modes, and each run's output is bit for bit its plan's alone:
    /// three MXFP8 runs of three backward modes round (and quantize) once, beside an NVFP4
    /// pair (per-token and per-tensor second scales: two groups) and a BF16 run.
    #[test]
    fn an_inference_pass_quantizes_runs_of_one_forward_as_one_group() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        let (n, k, m, per_run) = (5, 64, 32, 2);
        let per_tensor = SitePlan {
            act_scale: crate::formats::SecondScale::PerTensor,
            ..plan(Precision::Nvfp4, HighPrecision)
        };
        let cases: [(Vec<SitePlan>, usize); 3] = [
            (
                vec![
                    plan(Precision::Mxfp8, HighPrecision),
                    plan(Precision::Mxfp8, Dequantized),
                    plan(Precision::Mxfp8, Quantized),
                ],
                1,
            ),
            (
                vec![
                    plan(Precision::Bf16, HighPrecision),
                    plan(Precision::Nvfp4, Dequantized),
                    plan(Precision::Nvfp4, HighPrecision),
                    per_tensor,
                    plan(Precision::Mxfp8, Quantized),
                ],
                // BF16's rounding, one per-token NVFP4 group, per-tensor, MXFP8.
                4,
            ),
            (
                vec![
                    plan(Precision::Mxfp8, HighPrecision),
                    plan(Precision::Nvfp4, Dequantized),
                    plan(Precision::Mxfp8, Dequantized),
                ],
                3,
            ),
        ];
        for (plans, roundings) in cases {
            let batch = plans.len() * per_run;
            let (xl, yl) = (n * k, n * m);
            let x = data(batch * xl, 0.5);
            let w = forward_stack(&plans, per_run, m, k);
            let apply = |k_: &Blocked, plans: &[SitePlan], blocks: std::ops::Range<usize>| {
                let nb = blocks.len();
                let site = SiteWeight {
                    fwd: &w[blocks.start * m * k..blocks.end * m * k],
                    bwd: &w[blocks.start * m * k..blocks.end * m * k],
                    out_dim: m,
                    in_dim: k,
                    batch: nb,
                };
                let xs = &x[blocks.start * xl..blocks.end * xl];
                let mut y = vec![0.0f32; nb * yl];
                infallible(apply_on(k_, plans, xs, n, &site, &mut y));
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let joint_k = Blocked::default();
            let joint = apply(&joint_k, &plans, 0..batch);
            let case: Vec<_> = plans.iter().map(|p| (p.precision, p.backward)).collect();
            assert_eq!(joint_k.roundings.get(), roundings, "{case:?}: roundings");
            for (r, p) in plans.iter().enumerate() {
                let blocks = r * per_run..(r + 1) * per_run;
                let alone = apply(&Blocked::default(), std::slice::from_ref(p), blocks.clone());
                let got = &joint[blocks.start * yl..blocks.end * yl];
                assert_eq!(got, &alone[..], "{case:?}: run {r}");
            }
        }
    }

    /// A quantizer that rounds its input as it loads leaves no rounded copy where nothing reads
    /// it: an inference pass rounds nothing, a training forward only what its backward reads
    /// (the `HighPrecision` and `Quantized` modes' kept rounding; the `Dequantized` mode rounds
    /// the quantized input for its wgrad), alone and in groups of several plans, with the same
    /// bits as rounding first.
    #[test]
    fn a_quantizer_that_rounds_as_it_loads_leaves_no_copy_nothing_reads() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        let (n, k, m, per_run) = (5, 64, 32, 2);
        let mx = |b| plan(Precision::Mxfp8, b);
        let nv = |b| plan(Precision::Nvfp4, b);
        // Plans, and the roundings of a training forward with a quantizer that loads rounded.
        let cases: [(Vec<SitePlan>, usize); 5] = [
            (vec![mx(HighPrecision)], 1),
            (vec![mx(Dequantized)], 1),
            (vec![nv(Quantized)], 1),
            (vec![nv(Dequantized), mx(HighPrecision), nv(Dequantized)], 3),
            (vec![mx(Dequantized), nv(Dequantized)], 2),
        ];
        for (plans, forward_roundings) in cases {
            let batch = plans.len() * per_run;
            let x = data(batch * n * k, 0.5);
            let w = forward_stack(&plans, per_run, m, k);
            let site = SiteWeight {
                fwd: &w[..],
                bwd: &w[..],
                out_dim: m,
                in_dim: k,
                batch,
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // (y and the kept operand of a training forward, y of an inference pass), roundings.
            let passes = |kernels: &Blocked| {
                let mut y = vec![0.0f32; batch * n * m];
                let kept = infallible(forward_on(kernels, &plans, &x, n, &site, &mut y, None));
                let trained = kernels.roundings.replace(0);
                let mut y_inf = vec![0.0f32; batch * n * m];
                infallible(apply_on(kernels, &plans, &x, n, &site, &mut y_inf));
                let inferred = kernels.roundings.get();
                ([bits(&y), bits(&kept), bits(&y_inf)], (trained, inferred))
            };
            let loading = Blocked {
                loads_rounded: true,
                ..Blocked::default()
            };
            let (fast, roundings) = passes(&loading);
            let (slow, _) = passes(&Blocked::default());
            let case: Vec<_> = plans.iter().map(|p| (p.precision, p.backward)).collect();
            assert_eq!(fast, slow, "{case:?}: the same bits");
            assert_eq!(roundings, (forward_roundings, 0), "{case:?}: roundings");
        }
    }

    /// A backward whose dgrad and wgrad GEMMs round their operands to BF16 gives them dy
    /// unrounded where no group quantizes it, with the same dx and dW bits as rounding first:
    /// no rounding of dy at all (one plan, or several none of which quantizes dy), one for a
    /// group that quantizes it (MXFP8 `Quantized`: BF16 operands), and every group's as before
    /// where a GEMM is FP32 (NVFP4 `Quantized`).
    #[test]
    fn a_backward_leaves_dy_rounding_to_gemms_that_round() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        let (n, k, m, per_run) = (5, 64, 32, 2);
        let bf = plan(Precision::Bf16, HighPrecision);
        let mx = |b| plan(Precision::Mxfp8, b);
        let nv = |b| plan(Precision::Nvfp4, b);
        // Plans, and the backward's roundings with GEMMs that round (rounding first: one a group).
        let cases: [(Vec<SitePlan>, usize); 6] = [
            (vec![bf], 0),
            (vec![mx(HighPrecision)], 0),
            (vec![mx(Quantized)], 1),
            (vec![nv(Dequantized), mx(HighPrecision), bf], 0),
            (vec![nv(Quantized), mx(HighPrecision)], 2),
            (vec![mx(Quantized), bf, mx(Dequantized)], 1),
        ];
        for (plans, roundings) in cases {
            let batch = plans.len() * per_run;
            let x = data(batch * n * k, 0.5);
            let dy = data(batch * n * m, 1.5);
            let prepared: Vec<PreparedWeight> = (0..batch)
                .map(|b| prepare_weight(&plans[b / per_run], &data(m * k, 3.0 + b as f32), m, k))
                .collect();
            let fwd: Vec<f32> = prepared.iter().flat_map(|p| p.w_fwd().to_vec()).collect();
            let bwd: Vec<f32> = prepared.iter().flat_map(|p| p.w_bwd().to_vec()).collect();
            let site = SiteWeight {
                fwd: &fwd[..],
                bwd: &bwd[..],
                out_dim: m,
                in_dim: k,
                batch,
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // dx and dW, and the backward's roundings.
            let pass = |kernels: &Blocked| {
                let mut y = vec![0.0f32; batch * n * m];
                let kept = infallible(forward_on(kernels, &plans, &x, n, &site, &mut y, None));
                kernels.roundings.set(0);
                let (mut dx, mut dw) = (vec![0.0f32; batch * n * k], data(batch * m * k, 2.5));
                let dx_ = Some(&mut dx[..]);
                infallible(backward_on(
                    kernels, &plans, &kept, n, &site, &dy, dx_, &mut dw,
                ));
                ([bits(&dx), bits(&dw)], kernels.roundings.get())
            };
            let rounding = Blocked {
                gemm_rounds: true,
                ..Blocked::default()
            };
            let (fast, fast_roundings) = pass(&rounding);
            let (slow, slow_roundings) = pass(&Blocked::default());
            let case: Vec<_> = plans.iter().map(|p| (p.precision, p.backward)).collect();
            assert_eq!(fast, slow, "{case:?}: dx and dW");
            assert_eq!(fast_roundings, roundings, "{case:?}: roundings");
            let groups = plan_groups(&plans, batch).len();
            assert_eq!(
                slow_roundings, groups,
                "{case:?}: roundings, rounding first"
            );
        }
    }

    /// Which GEMMs may run on BF16 tensor cores, by precision and backward mode: the forward,
    /// dgrad and wgrad GEMMs of a two-block site are told `Operands::Bf16` exactly where the
    /// table says, and `Blocked` checks that every operand so labelled holds only BF16 values
    /// (the weights and activations are not BF16 values before rounding).
    #[test]
    fn gemms_are_told_their_operands_hold_bf16_values_exactly_where_they_do() {
        use BackwardMode::{Dequantized, HighPrecision, Quantized};
        use Operands::{Bf16, Fp32};
        let (n, k, m, batch) = (5, 64, 32, 2);
        let table = [
            (Precision::Fp32, HighPrecision, [Fp32, Fp32, Fp32]),
            (Precision::Bf16, HighPrecision, [Bf16, Bf16, Bf16]),
            (Precision::Bf16, Quantized, [Bf16, Bf16, Bf16]),
            (Precision::Mxfp8, HighPrecision, [Bf16, Bf16, Bf16]),
            (Precision::Mxfp8, Dequantized, [Bf16, Bf16, Bf16]),
            (Precision::Mxfp8, Quantized, [Bf16, Bf16, Bf16]),
            (Precision::Nvfp4, HighPrecision, [Fp32, Bf16, Bf16]),
            (Precision::Nvfp4, Dequantized, [Fp32, Bf16, Bf16]),
            (Precision::Nvfp4, Quantized, [Fp32, Fp32, Fp32]),
            (Precision::Fp8Block, HighPrecision, [Fp32, Bf16, Bf16]),
            (Precision::Fp8Block, Dequantized, [Fp32, Bf16, Bf16]),
            (Precision::Fp8Block, Quantized, [Fp32, Fp32, Fp32]),
        ];
        let x = data(batch * n * k, 0.5);
        let dy = data(batch * n * m, 1.5);
        for (p, b, want) in table {
            let sp = if p == Precision::Fp32 {
                SitePlan::FP32
            } else {
                plan(p, b)
            };
            let ws: Vec<PreparedWeight> = (0..batch)
                .map(|i| prepare_weight(&sp, &data(m * k, 3.0 + i as f32), m, k))
                .collect();
            let fwd: Vec<f32> = ws.iter().flat_map(|w| w.w_fwd().to_vec()).collect();
            let bwd: Vec<f32> = ws.iter().flat_map(|w| w.w_bwd().to_vec()).collect();
            let w = SiteWeight {
                fwd: &fwd[..],
                bwd: &bwd[..],
                out_dim: m,
                in_dim: k,
                batch,
            };
            let kernels = Blocked::default();
            let plans = std::slice::from_ref(&sp);
            let mut y = vec![0.0f32; batch * n * m];
            let kept = infallible(forward_on(&kernels, plans, &x, n, &w, &mut y, None));
            let (mut dx, mut dw) = (vec![0.0f32; x.len()], vec![0.0f32; fwd.len()]);
            let back = backward_on(&kernels, plans, &kept, n, &w, &dy, Some(&mut dx), &mut dw);
            infallible(back);
            assert_eq!(kernels.gemms.borrow()[..], want, "{p:?} {b:?}");
        }
    }
}
