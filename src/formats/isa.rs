//! One kernel source compiled for several x86-64 instruction sets and picked at run time.
//!
//! The row quantizers are plain Rust that LLVM vectorises; the widest vectors the CPU offers make
//! them several times faster than the SSE2 baseline. [`per_isa!`] compiles one kernel function
//! once per [`Isa`] (by `#[target_feature]` wrappers around the same inlined body), so every
//! compile runs the same arithmetic: Rust never contracts a multiply and an add into an FMA, and
//! no approximate instruction is ever generated without being written, so the bytes cannot
//! depend on the compile. Tests still run every compile the CPU supports against the block
//! reference.

/// An instruction set a kernel is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The target's baseline (SSE2 on x86-64).
    Baseline,
    /// AVX2: 8 FP32 lanes.
    Avx2,
    /// AVX-512 F/BW/DQ/VL: 16 FP32 lanes and mask registers for the compares.
    Avx512,
}

impl Isa {
    /// Every compile, baseline first.
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run code compiled for `self` (the detection is cached by std).
    pub fn available(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The compile the quantizers use: the widest this CPU runs, capped by the environment
    /// variable `LOCKSTEP_ISA` (`baseline`, `avx2` or `avx512`) when set, so compiles can be
    /// timed against each other. Read once per process.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = match std::env::var("LOCKSTEP_ISA").as_deref() {
                Ok("baseline") => Isa::Baseline,
                Ok("avx2") => Isa::Avx2,
                _ => Isa::Avx512,
            };
            Isa::ALL
                .into_iter()
                .rev()
                .find(|i| *i <= cap && i.available())
                .unwrap_or(Isa::Baseline)
        })
    }
}

/// `per_isa! { fn name(args) -> Ret = kernel; }` defines `fn name(isa: Isa, args) -> Ret` that
/// runs `kernel(args)` compiled for `isa` (the baseline compile when the CPU lacks `isa`).
/// `kernel` should be `#[inline(always)]` so each wrapper gets its own compile of the body.
macro_rules! per_isa {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $kernel:path;) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(isa: $crate::formats::isa::Isa, $($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                use $crate::formats::isa::Isa;
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $kernel($($arg),*)
                }
                #[target_feature(enable = "avx2,avx512f,avx512bw,avx512dq,avx512vl")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $kernel($($arg),*)
                }
                if isa == Isa::Avx512 && Isa::Avx512.available() {
                    // SAFETY: the CPU supports these features, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if isa == Isa::Avx2 && Isa::Avx2.available() {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            let _ = isa;
            $kernel($($arg),*)
        }
    };
}

pub(crate) use per_isa;

/// Asks the CPU to bring the cache line holding `p` into L1. A hint only: it never faults
/// and changes no result, whatever the address (so `p` may point past an allocation; build it
/// with `wrapping_add`). No-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing into the program and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
