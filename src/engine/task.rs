//! Verifiable tasks with exact-match rewards, generated from a seed, each with a held-out
//! evaluation set (prompts whose operands never appear in training: training draws from a hash
//! partition the evaluation set excludes).
//!
//! Vocabulary (32 ids): digits 0–9 are ids 0–9, then `+`, `=`, `<eos>`, `<pad>`, `S` (sort marker).
//! Every prompt of a task has the same length, so a batch is a `[B, T]` block with no padding
//! inside prompts; responses end with `<eos>` and are padded after it.
//!
//! - `add:N`: `a+b=` with N-digit operands (zero-padded); the answer is the sum written least
//!   significant digit first, N+1 digits, then `<eos>`. LSB-first is the standard way to make
//!   addition learnable by a small causal model (each digit depends on already written ones).
//! - `sort:N`: `S d1..dN =`; the answer is the N digits in ascending order, then `<eos>`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub const PLUS: u32 = 10;
pub const EQ: u32 = 11;
pub const EOS: u32 = 12;
pub const PAD: u32 = 13;
pub const SORT: u32 = 14;
/// Ids the tasks use (the model's vocabulary may be larger).
pub const VOCAB_USED: usize = 15;

/// A task and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", content = "digits", rename_all = "lowercase")]
pub enum Task {
    Add(usize),
    Sort(usize),
}

/// One prompt with its reference answer (tokens, `<eos>` included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub prompt: Vec<u32>,
    pub answer: Vec<u32>,
}

/// A malformed task name.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown task `{0}`: use add:N (N-digit addition, 1-6) or sort:N (sort N digits, 2-12), e.g. add:3"
)]
pub struct TaskError(pub String);

impl std::str::FromStr for Task {
    type Err = TaskError;
    fn from_str(s: &str) -> Result<Task, TaskError> {
        let err = || TaskError(s.to_string());
        let (kind, n) = s.split_once(':').ok_or_else(err)?;
        let n: usize = n.parse().map_err(|_| err())?;
        match kind {
            "add" if (1..=6).contains(&n) => Ok(Task::Add(n)),
            "sort" if (2..=12).contains(&n) => Ok(Task::Sort(n)),
            _ => Err(err()),
        }
    }
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Task::Add(n) => write!(f, "add:{n}"),
            Task::Sort(n) => write!(f, "sort:{n}"),
        }
    }
}

/// Which split a problem is drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Eval,
}

impl Task {
    pub fn prompt_len(&self) -> usize {
        match self {
            Task::Add(n) => 2 * n + 2,
            Task::Sort(n) => n + 2,
        }
    }

    /// Tokens of a correct response, `<eos>` included.
    pub fn answer_len(&self) -> usize {
        match self {
            Task::Add(n) => n + 2,
            Task::Sort(n) => n + 1,
        }
    }

    /// The problem built from raw operand digits.
    fn build(&self, digits: &[u32]) -> Problem {
        match *self {
            Task::Add(n) => {
                let (a, b) = digits.split_at(n);
                let mut prompt = a.to_vec();
                prompt.push(PLUS);
                prompt.extend_from_slice(b);
                prompt.push(EQ);
                let val = |ds: &[u32]| ds.iter().fold(0u64, |v, d| v * 10 + *d as u64);
                let mut s = val(a) + val(b);
                let mut answer: Vec<u32> = (0..=n)
                    .map(|_| {
                        let d = (s % 10) as u32;
                        s /= 10;
                        d
                    })
                    .collect();
                answer.push(EOS);
                Problem { prompt, answer }
            }
            Task::Sort(_) => {
                let mut prompt = vec![SORT];
                prompt.extend_from_slice(digits);
                prompt.push(EQ);
                let mut answer = digits.to_vec();
                answer.sort_unstable();
                answer.push(EOS);
                Problem { prompt, answer }
            }
        }
    }

    fn n_digits(&self) -> usize {
        match *self {
            Task::Add(n) => 2 * n,
            Task::Sort(n) => n,
        }
    }

    /// `count` problems of `split`, deterministic in `seed`. About 1 problem in 8 belongs to the
    /// evaluation split (a hash of the operand digits decides), so training never sees them.
    pub fn sample(&self, split: Split, count: usize, seed: u64) -> Vec<Problem> {
        let salt = match split {
            Split::Train => 0x7261_696E,
            Split::Eval => 0x6576_616C,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ salt);
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let digits: Vec<u32> = (0..self.n_digits())
                .map(|_| rng.random_range(0..10))
                .collect();
            if is_eval(&digits) == (split == Split::Eval) {
                out.push(self.build(&digits));
            }
        }
        out
    }

    /// Exact-match reward: 1 when the response up to and including `<eos>` equals the answer.
    pub fn reward(&self, problem: &Problem, response: &[u32]) -> f32 {
        let end = response
            .iter()
            .position(|&t| t == EOS)
            .map(|i| i + 1)
            .unwrap_or(response.len());
        f32::from(u8::from(response[..end] == problem.answer[..]))
    }
}

/// Held-out membership: a fixed hash of the operand digits, 1 in 8.
fn is_eval(digits: &[u32]) -> bool {
    let h = digits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, d| {
        (h ^ (*d as u64 + 1)).wrapping_mul(0x100_0000_01b3)
    });
    h % 8 == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addition_answers_lsb_first() {
        let p = Task::Add(3).build(&[1, 2, 3, 9, 8, 7]);
        assert_eq!(p.prompt, vec![1, 2, 3, PLUS, 9, 8, 7, EQ]);
        // 123 + 987 = 1110 -> digits LSB first: 0,1,1,1
        assert_eq!(p.answer, vec![0, 1, 1, 1, EOS]);
        assert_eq!(p.prompt.len(), Task::Add(3).prompt_len());
        assert_eq!(p.answer.len(), Task::Add(3).answer_len());
        let s = Task::Sort(4).build(&[3, 1, 2, 1]);
        assert_eq!(s.prompt, vec![SORT, 3, 1, 2, 1, EQ]);
        assert_eq!(s.answer, vec![1, 1, 2, 3, EOS]);
    }

    #[test]
    fn rewards_are_exact_match_up_to_eos() {
        let t = Task::Add(1);
        let p = t.build(&[5, 7]); // 12 -> 2,1
        assert_eq!(t.reward(&p, &[2, 1, EOS, PAD, PAD]), 1.0);
        assert_eq!(t.reward(&p, &[2, 1, EOS, 3, 3]), 1.0); // after <eos> nothing counts
        assert_eq!(t.reward(&p, &[2, 1, 0, EOS]), 0.0);
        assert_eq!(t.reward(&p, &[2, 1]), 0.0); // no <eos>
        assert_eq!(t.reward(&p, &[1, 2, EOS]), 0.0);
    }

    #[test]
    fn sorting_is_rewarded_for_the_digits_in_ascending_order_then_eos() {
        let t = Task::Sort(5);
        let p = t.build(&[9, 0, 4, 4, 1]);
        assert_eq!(p.prompt.len(), t.prompt_len());
        assert_eq!(p.answer.len(), t.answer_len());
        assert_eq!(t.reward(&p, &[0, 1, 4, 4, 9, EOS]), 1.0);
        assert_eq!(t.reward(&p, &[0, 1, 4, 4, 9, EOS, 7, PAD]), 1.0); // nothing counts after <eos>
        assert_eq!(t.reward(&p, &[0, 1, 4, 9, EOS]), 0.0); // a repeated digit dropped
        assert_eq!(t.reward(&p, &[9, 4, 4, 1, 0, EOS]), 0.0); // descending
        assert_eq!(t.reward(&p, &[0, 1, 4, 4, 9]), 0.0); // no <eos>
        assert_eq!(t.reward(&p, &[9, 0, 4, 4, 1, EOS]), 0.0); // copied, not sorted
        // Every sampled problem's answer is its prompt's digits, sorted.
        for p in Task::Sort(8).sample(Split::Train, 50, 3) {
            let mut digits = p.prompt[1..9].to_vec();
            digits.sort_unstable();
            digits.push(EOS);
            assert_eq!((p.prompt[0], p.prompt[9], &p.answer), (SORT, EQ, &digits));
        }
    }

    #[test]
    fn sort_sizes_outside_2_to_12_are_refused() {
        for bad in ["sort:1", "sort:13", "sort:", "sort:x", "sort"] {
            let e = bad.parse::<Task>().unwrap_err().to_string();
            assert!(e.contains("sort:N (sort N digits, 2-12)"), "{bad}: {e}");
        }
        assert_eq!("sort:12".parse::<Task>(), Ok(Task::Sort(12)));
        assert_eq!(Task::Sort(12).to_string(), "sort:12");
    }

    #[test]
    fn splits_are_disjoint_and_seeded() {
        for task in [Task::Add(2), Task::Sort(5)] {
            let train = task.sample(Split::Train, 500, 1);
            let eval = task.sample(Split::Eval, 100, 1);
            assert!(
                eval.iter().all(|e| !train.contains(e)),
                "{task}: eval prompt leaked into training"
            );
            assert_eq!(train, task.sample(Split::Train, 500, 1));
            assert_ne!(train, task.sample(Split::Train, 500, 2));
        }
    }

    #[test]
    fn parses_task_names() {
        assert_eq!("add:3".parse::<Task>(), Ok(Task::Add(3)));
        assert_eq!("sort:5".parse::<Task>(), Ok(Task::Sort(5)));
        assert!("add:9".parse::<Task>().is_err());
        assert!(
            "mul:2"
                .parse::<Task>()
                .unwrap_err()
                .to_string()
                .contains("add:N")
        );
    }
}
