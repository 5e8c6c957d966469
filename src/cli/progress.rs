//! The progress display of `lockstep run`. Start, finish and skip events are always whole lines.
//! Steps are shown differently by where stdout goes: into a file or pipe (a CI log), a plain line
//! per run every 10 steps; on a terminal, one status line redrawn in place with every active run's
//! step and device, the done/failed counts and the ETA.

use lockstep::suite::runner::Progress;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

/// The longest status line drawn (longer ones are cut), so it never wraps on a common terminal:
/// a wrapped line could not be erased in place.
const STATUS_WIDTH: usize = 100;

/// A run being worked on.
struct Active {
    label: String,
    step: usize,
    steps: usize,
    device: String,
}

/// What one event prints: whole lines, then (on a terminal) the status line to redraw.
#[derive(Debug, Default, PartialEq)]
pub struct Output {
    pub lines: Vec<String>,
    pub status: Option<String>,
}

/// Counts and active runs of one `lockstep run`.
pub struct Board {
    total: usize,
    done: usize,
    failed: usize,
    tty: bool,
    start: Instant,
    active: BTreeMap<String, Active>,
}

impl Board {
    pub fn new(total: usize, tty: bool) -> Board {
        Board {
            total,
            done: 0,
            failed: 0,
            tty,
            start: Instant::now(),
            active: BTreeMap::new(),
        }
    }

    /// Update the board with one event and say what to print.
    pub fn event(&mut self, p: Progress<'_>) -> Output {
        let total = self.total;
        let mut lines = Vec::new();
        match p {
            Progress::Skipped { run } => {
                self.done += 1;
                lines.push(format!(
                    "[{}/{total}] skip {} seed {} (finished)",
                    self.done, run.config, run.seed
                ));
            }
            Progress::Busy { run } => lines.push(format!(
                "[{}/{total}] busy {} seed {} (another process holds it)",
                self.done, run.config, run.seed
            )),
            Progress::Started { run, device } => {
                lines.push(format!(
                    "[{}/{total}] start {} seed {} on {device}",
                    self.done, run.config, run.seed
                ));
                self.active.insert(
                    run.run_id.clone(),
                    Active {
                        label: format!("{} s{}", run.config, run.seed),
                        step: 0,
                        steps: run.run.steps,
                        device: device.to_string(),
                    },
                );
            }
            Progress::Step { run, record } => {
                let mut device = String::new();
                if let Some(a) = self.active.get_mut(&run.run_id) {
                    a.step = record.step + 1;
                    device = format!(" on {}", a.device);
                }
                if !self.tty && record.step % 10 == 0 {
                    lines.push(format!(
                        "  {} s{} step {}/{}{device} reward {:.3} (done {}/{total}, failed {}, ETA {})",
                        run.config,
                        run.seed,
                        record.step + 1,
                        run.run.steps,
                        record.get("rollout/raw_reward").unwrap_or(f64::NAN),
                        self.done,
                        self.failed,
                        self.eta()
                    ));
                }
            }
            Progress::Finished { run, status, error } => {
                self.active.remove(&run.run_id);
                self.done += 1;
                if !matches!(status, lockstep::store::RunStatus::Ok) {
                    self.failed += 1;
                }
                lines.push(format!(
                    "[{}/{total}] {:?} {} seed {}{} (ETA {})",
                    self.done,
                    status,
                    run.config,
                    run.seed,
                    error.map(|e| format!(": {e}")).unwrap_or_default(),
                    self.eta()
                ));
            }
            Progress::DeviceLost { device, error } => lines.push(format!(
                "{device} stopped computing ({error}); its runs go to the other devices"
            )),
        }
        Output {
            lines,
            status: self.tty.then(|| self.status_line()),
        }
    }

    /// Share of the work done, counting the steps of active runs.
    fn fraction(&self) -> f64 {
        let partial: f64 = self
            .active
            .values()
            .map(|a| a.step as f64 / a.steps.max(1) as f64)
            .sum();
        (self.done as f64 + partial) / self.total.max(1) as f64
    }

    fn eta(&self) -> String {
        let f = self.fraction();
        if f <= 0.0 {
            return "?".into();
        }
        let elapsed = self.start.elapsed().as_secs_f64();
        format!("{:.0}s", elapsed * (1.0 - f).max(0.0) / f)
    }

    /// `[7/30 done, 0 failed, ETA 1213s] bf16 s3 12/40 cpu | mxfp8 s1 5/40 cpu`, cut to fit.
    fn status_line(&self) -> String {
        let runs: Vec<String> = self
            .active
            .values()
            .map(|a| format!("{} {}/{} {}", a.label, a.step, a.steps, a.device))
            .collect();
        let line = format!(
            "[{}/{} done, {} failed, ETA {}] {}",
            self.done,
            self.total,
            self.failed,
            self.eta(),
            runs.join(" | ")
        );
        match line.char_indices().nth(STATUS_WIDTH) {
            Some((cut, _)) => format!("{}…", &line[..cut]),
            None => line,
        }
    }
}

/// Print an event's output: on a terminal, erase the status line first and redraw it after.
pub fn print(out: &Output, tty: bool) {
    let mut stdout = std::io::stdout().lock();
    if tty {
        let _ = write!(stdout, "\r\x1b[2K");
    }
    for l in &out.lines {
        let _ = writeln!(stdout, "{l}");
    }
    if let Some(s) = &out.status {
        let _ = write!(stdout, "{s}");
    }
    let _ = stdout.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep::engine::metrics::StepRecord;
    use lockstep::store::RunStatus;
    use lockstep::suite::{expand, spec::parse};
    use std::path::Path;

    fn runs() -> Vec<lockstep::suite::plan::RunSpec> {
        let text = "name = \"p\"\nseeds = [0, 1]\n[workload]\nsteps = 20\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";
        expand(&parse(text, Path::new("p.toml")).unwrap()).unwrap()
    }

    fn step(b: &mut Board, run: &lockstep::suite::plan::RunSpec, s: usize) -> Output {
        let record = StepRecord {
            step: s,
            ..Default::default()
        };
        b.event(Progress::Step {
            run,
            record: &record,
        })
    }

    #[test]
    fn a_log_gets_a_line_every_ten_steps_and_no_status_line() {
        let runs = runs();
        let mut b = Board::new(2, false);
        let out = b.event(Progress::Started {
            run: &runs[0],
            device: "cpu",
        });
        assert_eq!(out.lines, ["[0/2] start bf16 seed 0 on cpu"]);
        assert_eq!(out.status, None);
        let shown: Vec<usize> = (0..20)
            .filter(|&s| !step(&mut b, &runs[0], s).lines.is_empty())
            .collect();
        assert_eq!(shown, [0, 10]);
        assert!(
            step(&mut b, &runs[0], 10).lines[0].starts_with("  bf16 s0 step 11/20 on cpu reward")
        );
    }

    #[test]
    fn a_terminal_gets_one_status_line_with_every_active_run() {
        let runs = runs();
        let mut b = Board::new(2, true);
        for (r, dev) in runs.iter().zip(["cuda:0", "cuda:1"]) {
            b.event(Progress::Started {
                run: r,
                device: dev,
            });
        }
        let out = step(&mut b, &runs[0], 9);
        assert!(
            out.lines.is_empty(),
            "steps are not printed as lines on a terminal"
        );
        let s = out.status.unwrap();
        assert!(s.starts_with("[0/2 done, 0 failed, ETA "), "{s}");
        assert!(
            s.contains("bf16 s0 10/20 cuda:0 | bf16 s1 0/20 cuda:1"),
            "{s}"
        );
        assert!(!s.contains("ETA ?"), "a quarter of the work is done: {s}");
        let out = b.event(Progress::Finished {
            run: &runs[0],
            status: RunStatus::Failed,
            error: Some("boom".into()),
        });
        assert!(out.lines[0].starts_with("[1/2] Failed bf16 seed 0: boom"));
        let s = out.status.unwrap();
        assert!(
            s.starts_with("[1/2 done, 1 failed") && !s.contains("s0 "),
            "{s}"
        );
    }

    #[test]
    fn long_status_lines_are_cut_to_fit_a_terminal() {
        let runs = runs();
        let mut b = Board::new(2, true);
        for r in &runs {
            b.event(Progress::Started {
                run: r,
                device: "a-very-long-device-name-for-this-test-only",
            });
        }
        let s = b.status_line();
        assert_eq!(s.chars().count(), STATUS_WIDTH + 1, "{s}");
        assert!(s.ends_with('…'));
    }
}
