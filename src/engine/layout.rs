//! How the rows of a full forward pass are laid out.
//!
//! GRPO samples n responses to each prompt, so the n sequences of a group share their first P
//! tokens. Under causal attention those P positions compute the same values in every sequence of
//! the group (every op but attention is per row, attention at a prompt position only reads prompt
//! positions, and every quantizer works per row or per token), so the trainer computes them once:
//! a group's rows are its P prompt rows followed by each sample's own rows. And a sample needs no
//! row past the one that predicts its `<eos>`: nothing before it attends there, and no loss or
//! metric reads it. At the benchmark shape (8-token prompts, 8 samples, 15 input positions) the
//! first rule alone takes 3,840 rows down to 2,048; once responses end early the second takes it
//! further.
//!
//! A plain batch of B sequences of T tokens is the special case of B groups, each a T-row prefix
//! with no branches. Row values in a layout are the same bits the plain batch computes for that
//! position; only sums over rows (weight gradients) associate differently.

/// `groups` groups, each `prefix` shared rows (positions `0..prefix`) followed by `branches`
/// continuations; continuation s has `tails[s]` rows (positions `prefix..prefix + tails[s]`) and
/// attends to its group's prefix rows, then to its own rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    groups: usize,
    prefix: usize,
    branches: usize,
    /// Positions per sequence in the sequence-major view (T).
    seq_len: usize,
    /// The longest attention context of any row (`prefix + max tail` when branched).
    max_context: usize,
    /// Per sequence: rows of its own (its continuation), 0 for a plain batch.
    tails: Vec<usize>,
    /// First row of each group, then the row count: `groups + 1` entries.
    group_start: Vec<usize>,
    /// First row of each sequence's continuation.
    tail_start: Vec<usize>,
}

impl Layout {
    /// B independent sequences of T tokens each.
    pub fn plain(b: usize, t: usize) -> Layout {
        Layout {
            groups: b,
            prefix: t,
            branches: 0,
            seq_len: t,
            max_context: t,
            tails: vec![0; b],
            group_start: (0..=b).map(|g| g * t).collect(),
            tail_start: (0..b).map(|g| (g + 1) * t).collect(),
        }
    }

    /// The shared-prefix layout of `tokens` (`b` sequences of `t`, sequence-major) in groups of `n`
    /// consecutive sequences whose first `prefix` tokens are equal, sequence s keeping positions
    /// `0..used[s]` (all `t` when `used` is `None`). The plain layout when any group's prefixes
    /// differ, when `n` does not divide `b`, or when nothing would be shared.
    ///
    /// # Panics
    /// If `tokens` is not `[b, t]` or a `used` entry exceeds `t`.
    pub fn shared_prefix(
        tokens: &[u32],
        b: usize,
        t: usize,
        n: usize,
        prefix: usize,
        used: Option<&[usize]>,
    ) -> Layout {
        assert_eq!(tokens.len(), b * t, "shared_prefix: tokens are not [B, T]");
        if n < 2 || prefix == 0 || prefix > t || !b.is_multiple_of(n) {
            return Layout::plain(b, t);
        }
        let head = |s: usize| &tokens[s * t..][..prefix];
        if (0..b).any(|s| head(s) != head(s - s % n)) {
            return Layout::plain(b, t);
        }
        let tails: Vec<usize> = (0..b)
            .map(|s| {
                let u = used.map_or(t, |u| u[s]);
                assert!(
                    u <= t,
                    "shared_prefix: sequence {s} uses {u} of {t} positions"
                );
                u.saturating_sub(prefix)
            })
            .collect();
        let groups = b / n;
        let (mut group_start, mut tail_start) = (Vec::with_capacity(groups + 1), Vec::new());
        let mut row = 0;
        for g in 0..groups {
            group_start.push(row);
            row += prefix;
            for tail in &tails[g * n..(g + 1) * n] {
                tail_start.push(row);
                row += tail;
            }
        }
        group_start.push(row);
        Layout {
            groups,
            prefix,
            branches: n,
            seq_len: t,
            max_context: prefix + tails.iter().copied().max().unwrap_or(0),
            tails,
            group_start,
            tail_start,
        }
    }

    /// Positions per sequence in the sequence-major view.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The most keys any row attends to.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Sequences the layout holds.
    pub fn sequences(&self) -> usize {
        self.tails.len()
    }

    /// Rows in all.
    pub fn rows(&self) -> usize {
        self.group_start[self.groups]
    }

    /// Groups: sets of rows attention never crosses.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Row range of group `g`.
    pub fn group_rows(&self, g: usize) -> std::ops::Range<usize> {
        self.group_start[g]..self.group_start[g + 1]
    }

    /// The row that holds position `p` of sequence `s`, if the layout keeps it.
    pub fn row(&self, s: usize, p: usize) -> Option<usize> {
        let g = match self.branches {
            0 => s,
            n => s / n,
        };
        if p < self.prefix {
            Some(self.group_start[g] + p)
        } else if p - self.prefix < self.tails[s] {
            Some(self.tail_start[s] + (p - self.prefix))
        } else {
            None
        }
    }

    /// The group and the sequence-local index (`None` for a prefix row) of row `r`.
    fn locate(&self, r: usize) -> (usize, Option<usize>) {
        let g = self.group_start.partition_point(|&s| s <= r) - 1;
        let local = r - self.group_start[g];
        if local < self.prefix {
            return (g, None);
        }
        let first = g * self.branches;
        let s =
            first + self.tail_start[first..first + self.branches].partition_point(|&s| s <= r) - 1;
        (g, Some(s))
    }

    /// Position of row `r`.
    pub fn position(&self, r: usize) -> usize {
        match self.locate(r) {
            (g, None) => r - self.group_start[g],
            (_, Some(s)) => self.prefix + (r - self.tail_start[s]),
        }
    }

    /// Positions of every row, in row order.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.rows()).map(|r| self.position(r)).collect()
    }

    /// The keys row `r` attends to, in position order: how many, and the row of the j-th (its own
    /// row last).
    pub fn context(&self, r: usize) -> (usize, impl Fn(usize) -> usize + Copy) {
        let (g, seq) = self.locate(r);
        let g0 = self.group_start[g];
        let (tail0, len) = match seq {
            None => (g0, r - g0 + 1),
            Some(s) => (
                self.tail_start[s],
                self.prefix + (r - self.tail_start[s]) + 1,
            ),
        };
        let prefix = self.prefix;
        let key = move |j: usize| {
            if j < prefix {
                g0 + j
            } else {
                tail0 + (j - prefix)
            }
        };
        (len, key)
    }

    /// Sequence-major values (`width` per position, `[S·T, width]`) into layout rows; a shared row
    /// takes its group's first sequence's values (the rest are equal by construction), positions the
    /// layout does not keep are dropped.
    pub fn pack<T: Copy + Default>(&self, seq_major: &[T], width: usize) -> Vec<T> {
        let t = self.seq_len;
        assert_eq!(seq_major.len(), self.sequences() * t * width, "pack");
        let mut out = vec![T::default(); self.rows() * width];
        for s in (0..self.sequences()).rev() {
            for p in 0..t {
                if let Some(r) = self.row(s, p) {
                    out[r * width..][..width]
                        .copy_from_slice(&seq_major[(s * t + p) * width..][..width]);
                }
            }
        }
        out
    }

    /// Layout rows (`width` values each) back to sequence-major order, shared rows copied into every
    /// sequence of their group; positions the layout does not keep read `T::default()`.
    pub fn unpack<T: Copy + Default>(&self, rows: &[T], width: usize) -> Vec<T> {
        let t = self.seq_len;
        assert_eq!(rows.len(), self.rows() * width, "unpack");
        let mut out = vec![T::default(); self.sequences() * t * width];
        for s in 0..self.sequences() {
            for p in 0..t {
                if let Some(r) = self.row(s, p) {
                    out[(s * t + p) * width..][..width]
                        .copy_from_slice(&rows[r * width..][..width]);
                }
            }
        }
        out
    }

    /// The adjoint of [`Layout::unpack`]: sums sequence-major gradients into layout rows, in sequence
    /// order (a fixed order, so the bits never depend on threads); positions the layout does not
    /// keep must carry no gradient.
    pub fn fold(&self, seq_major: &[f32], width: usize) -> Vec<f32> {
        let t = self.seq_len;
        assert_eq!(seq_major.len(), self.sequences() * t * width, "fold");
        let mut out = vec![0.0f32; self.rows() * width];
        for s in 0..self.sequences() {
            for p in 0..t {
                let src = &seq_major[(s * t + p) * width..][..width];
                match self.row(s, p) {
                    Some(r) => out[r * width..][..width]
                        .iter_mut()
                        .zip(src)
                        .for_each(|(o, &g)| *o += g),
                    None => debug_assert!(
                        src.iter().all(|&g| g == 0.0),
                        "fold: gradient at a dropped position ({s}, {p})"
                    ),
                }
            }
        }
        out
    }

    /// `buf` ([rows, width]) cut into one mutable slice per group, for one task per group.
    pub fn split_groups<'a, T>(&self, mut buf: &'a mut [T], width: usize) -> Vec<&'a mut [T]> {
        assert_eq!(buf.len(), self.rows() * width, "split_groups");
        let mut out = Vec::with_capacity(self.groups);
        for g in 0..self.groups {
            let (head, rest) = buf.split_at_mut(self.group_rows(g).len() * width);
            out.push(head);
            buf = rest;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens_of(prompts: &[[u32; 2]], n: usize, tail: &[u32]) -> Vec<u32> {
        prompts
            .iter()
            .flat_map(|pr| {
                (0..n).flat_map(move |s| {
                    pr.iter()
                        .copied()
                        .chain(tail.iter().map(move |x| x + s as u32))
                })
            })
            .collect()
    }

    #[test]
    fn shared_prefix_needs_equal_prompts_in_each_group() {
        let toks = tokens_of(&[[1, 2], [3, 4]], 3, &[10, 20]);
        let l = Layout::shared_prefix(&toks, 6, 4, 3, 2, None);
        assert_eq!(
            (l.groups(), l.rows(), l.sequences(), l.seq_len()),
            (2, 16, 6, 4)
        );
        let mut bad = toks.clone();
        bad[4] = 9; // sequence 1 of group 0 has another prompt
        assert_eq!(
            Layout::shared_prefix(&bad, 6, 4, 3, 2, None),
            Layout::plain(6, 4)
        );
        assert_eq!(
            Layout::shared_prefix(&toks, 6, 4, 4, 2, None),
            Layout::plain(6, 4)
        );
        assert_eq!(
            Layout::shared_prefix(&toks, 6, 4, 1, 2, None),
            Layout::plain(6, 4)
        );
    }

    /// Every kept (sequence, position) has one row, whose position and attention context are those
    /// of the sequence; dropped positions have none.
    #[test]
    fn rows_positions_and_contexts_agree() {
        let toks: Vec<u32> = (0..4).flat_map(|s| [7, 8, 9, s, s, s]).collect();
        let used = [6, 3, 5, 4];
        let l = Layout::shared_prefix(&toks, 4, 6, 2, 3, Some(&used));
        // Group 0: p0 p1 p2 | a3 a4 a5 | (b keeps nothing past the prompt); group 1: p0 p1 p2 | c3 c4 | d3.
        assert_eq!(l.rows(), 3 + 3 + 3 + 2 + 1);
        assert_eq!(
            (l.group_rows(1), l.seq_len(), l.max_context()),
            (6..12, 6, 6)
        );
        let short = Layout::shared_prefix(&toks, 4, 6, 2, 3, Some(&[4, 3, 5, 4]));
        assert_eq!(
            (short.rows(), short.seq_len(), short.max_context()),
            (10, 6, 5)
        );
        for (s, &u) in used.iter().enumerate() {
            for p in 0..6 {
                let Some(r) = l.row(s, p) else {
                    assert!(p >= u, "sequence {s} position {p} lost");
                    continue;
                };
                assert!(p < u, "sequence {s} position {p} kept past its end");
                assert_eq!(l.position(r), p);
                let (len, key) = l.context(r);
                assert_eq!(len, p + 1);
                for j in 0..len {
                    assert_eq!(Some(key(j)), l.row(s, j), "s {s} p {p} j {j}");
                }
            }
        }
        let plain = Layout::plain(3, 4);
        assert_eq!(
            (plain.rows(), plain.row(2, 1), plain.position(9)),
            (12, Some(9), 1)
        );
        assert_eq!(plain.context(6).0, 3);
        assert_eq!(plain.split_groups(&mut [0u8; 12], 1).len(), 3);
    }

    #[test]
    fn pack_unpack_fold_round_trip() {
        let toks = tokens_of(&[[1, 2], [3, 4]], 3, &[10, 20]);
        let l = Layout::shared_prefix(&toks, 6, 4, 3, 2, None);
        let packed = l.pack(&toks, 1);
        assert_eq!(&packed[..8], &[1, 2, 10, 20, 11, 21, 12, 22]);
        assert_eq!(l.unpack(&packed, 1), toks);
        // fold is unpack's adjoint: <unpack(x), y> = <x, fold(y)>.
        let x: Vec<f32> = (0..l.rows() * 2).map(|i| (i as f32).sin()).collect();
        let y: Vec<f32> = (0..24 * 2).map(|i| (i as f32 * 0.7).cos()).collect();
        let lhs: f64 = l
            .unpack(&x, 2)
            .iter()
            .zip(&y)
            .map(|(a, b)| (a * b) as f64)
            .sum();
        let rhs: f64 = x
            .iter()
            .zip(l.fold(&y, 2))
            .map(|(a, b)| (a * b) as f64)
            .sum();
        assert!((lhs - rhs).abs() < 1e-4, "{lhs} vs {rhs}");
    }
}
