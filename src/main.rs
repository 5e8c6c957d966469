//! The `lockstep` binary: parse flags, call the library, map the outcome to an exit code.
//! Exit codes: 0 pass, 1 a check failed or a regression was found, 2 an error (bad input, I/O).

mod cli;

use clap::Parser;
use cli::{BenchCommand, Cli, Command};
use std::process::ExitCode;

const EXIT_PASS: u8 = 0;
const EXIT_FAIL: u8 = 1;
const EXIT_ERROR: u8 = 2;

fn main() -> ExitCode {
    keep_freed_memory();
    quiet_broken_pipe();
    let cli = Cli::parse();
    match dispatch(&cli.command) {
        Ok(true) => ExitCode::from(EXIT_PASS),
        Ok(false) => ExitCode::from(EXIT_FAIL),
        Err(e) => match e.downcast_ref::<cli::suite::Interrupted>() {
            Some(i) => {
                eprintln!("{i}");
                ExitCode::from(lockstep::suite::interrupt::exit_code(i.0))
            }
            None => {
                // One line whatever the error (a parser's snippet or a name holding a newline),
                // so logs and scripts see one error per line.
                eprintln!("error: {}", lockstep::io::one_line(&format!("{e:#}")));
                ExitCode::from(EXIT_ERROR)
            }
        },
    }
}

/// `lockstep recipe show ... | head` closes stdout early; `println!` then panics with "failed
/// printing to stdout: Broken pipe". A reader that stopped reading is not an error: end quietly
/// with exit 0, as `cat` and ripgrep do. Every other panic keeps the default report.
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to std") && msg.contains("Broken pipe") {
            std::process::exit(i32::from(EXIT_PASS));
        }
        default(info)
    }));
}

/// glibc hands buffers of 128 KiB and more back to the kernel on free (mmap/munmap, heap trim), so
/// an engine step that allocates and drops multi-megabyte activations every layer paid for the
/// kernel zeroing fresh (huge) pages again and again: 12 % of a BF16 step under `perf`. Serving
/// them from the heap and never trimming it keeps the pages and reuses them. Memory use grows to
/// the step's peak and stays there, which is what a training process wants.
fn keep_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator tunables; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

fn dispatch(cmd: &Command) -> anyhow::Result<bool> {
    match cmd {
        Command::Quantize(args) => cli::quantize::run(args),
        Command::RunOne(args) => cli::engine::run_one_cmd(args),
        Command::Recipe(cmd) => cli::engine::recipe_cmd(cmd),
        Command::Suite(cmd) => cli::suite::suite_cmd(cmd),
        Command::Run(args) => cli::suite::run_cmd(args),
        Command::SweepWorker => cli::workers::worker_cmd(),
        Command::Runs(cmd) => cli::suite::runs_cmd(cmd),
        Command::Ingest(args) => cli::suite::ingest_cmd(args),
        Command::Compare(args) => cli::compare::compare_cmd(args),
        Command::Baseline(cmd) => cli::compare::baseline_cmd(cmd),
        Command::Nightly(args) => cli::compare::nightly_cmd(args),
        Command::Bench(BenchCommand::Compare {
            runs,
            steps,
            configs,
            sites,
            no_io,
            io: _,
        }) => cli::compare::bench_compare(*runs, *steps, *configs, *sites, !*no_io),
        Command::Bench(BenchCommand::Engine {
            steps,
            recipes,
            gemm_size,
            pytorch,
            python,
            pytorch_script,
        }) => {
            let peer = pytorch.then_some((python.as_path(), pytorch_script.as_path()));
            cli::engine::bench_engine_cmd(*steps, recipes, *gemm_size, peer)
        }
        Command::Report(args) => cli::report::run(args),
        Command::Bench(BenchCommand::Report(args)) => cli::report::bench(args),
        Command::Bench(BenchCommand::Quantize {
            size, device, reps, ..
        }) if device != "cpu" => cli::bench::quantize_gpu(device, *size, *reps),
        Command::Bench(BenchCommand::Step(args)) => cli::bench::step(args),
        Command::Bench(BenchCommand::Forward(args)) => cli::bench::forward(args),
        Command::Bench(BenchCommand::Decode(args)) => cli::bench::decode(args),
        Command::Bench(BenchCommand::Sweep(args)) => cli::bench_sweep::sweep(args),
        Command::Bench(BenchCommand::Quantize {
            size,
            min_time,
            only,
            ..
        }) => cli::bench::quantize_cpu(size.unwrap_or(4096), *min_time, only.as_deref()),
    }
}
