//! How the rows of a full forward pass are laid out.
//!
//! GRPO samples n responses to each prompt, so the n sequences of a group share their first P
//! tokens. Under causal attention those P positions compute the same values in every sequence of
//! the group (every op but attention is per row, attention at a prompt position only reads prompt
//! positions, and every quantizer works per row or per token), so the trainer computes them once:
//! a group's rows are its P prompt rows followed by each sample's own rows. At the benchmark shape
//! (8-token prompts, 8 samples, 15 input positions) that is 2,048 rows instead of 3,840.
//!
//! A plain batch of B sequences of T tokens is the special case of B groups, each a T-row prefix
//! with no branches. Row values in a layout are the same bits the plain batch computes for that
//! position; only sums over rows (weight gradients) associate differently.

/// `groups` groups, each `prefix` shared rows (positions `0..prefix`) followed by `branches`
/// continuations of `tail` rows (positions `prefix..prefix + tail`). A continuation's rows attend
/// to the group's prefix rows, then to its own rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub groups: usize,
    pub prefix: usize,
    pub branches: usize,
    pub tail: usize,
}

impl Layout {
    /// B independent sequences of T tokens each.
    pub fn plain(b: usize, t: usize) -> Layout {
        Layout {
            groups: b,
            prefix: t,
            branches: 0,
            tail: 0,
        }
    }

    /// The shared-prefix layout of `tokens` (`b` sequences of `t`, sequence-major) in groups of `n`
    /// consecutive sequences whose first `prefix` tokens are equal; the plain layout when any group's
    /// prefixes differ, when `n` does not divide `b`, or when nothing would be shared.
    pub fn shared_prefix(tokens: &[u32], b: usize, t: usize, n: usize, prefix: usize) -> Layout {
        assert_eq!(tokens.len(), b * t, "shared_prefix: tokens are not [B, T]");
        let plain = Layout::plain(b, t);
        if n < 2 || prefix == 0 || prefix > t || !b.is_multiple_of(n) {
            return plain;
        }
        let head = |s: usize| &tokens[s * t..][..prefix];
        if (0..b).any(|s| head(s) != head(s - s % n)) {
            return plain;
        }
        Layout {
            groups: b / n,
            prefix,
            branches: n,
            tail: t - prefix,
        }
    }

    /// Positions per sequence.
    pub fn seq_len(&self) -> usize {
        self.prefix + self.tail
    }

    /// Sequences the layout holds.
    pub fn sequences(&self) -> usize {
        self.groups * self.branches.max(1)
    }

    /// Rows of one group.
    pub fn group_rows(&self) -> usize {
        self.prefix + self.branches * self.tail
    }

    /// Rows in all.
    pub fn rows(&self) -> usize {
        self.groups * self.group_rows()
    }

    /// The row that holds position `p` of sequence `s`.
    pub fn row(&self, s: usize, p: usize) -> usize {
        let (g, branch) = match self.branches {
            0 => (s, 0),
            n => (s / n, s % n),
        };
        g * self.group_rows() + self.local_row(branch, p)
    }

    /// Row within a group of position `p` of the group's `branch`-th sequence.
    fn local_row(&self, branch: usize, p: usize) -> usize {
        if p < self.prefix {
            p
        } else {
            self.prefix + branch * self.tail + (p - self.prefix)
        }
    }

    /// Position of a group's local row `i`.
    pub fn local_position(&self, i: usize) -> usize {
        if i < self.prefix {
            i
        } else {
            self.prefix + (i - self.prefix) % self.tail
        }
    }

    /// Position of row `r`.
    pub fn position(&self, r: usize) -> usize {
        self.local_position(r % self.group_rows())
    }

    /// The keys a group's local row `i` attends to, in position order: how many, and the local row of
    /// the j-th (its own row last).
    pub fn context(&self, i: usize) -> (usize, impl Fn(usize) -> usize + Copy) {
        let (branch_start, len) = if i < self.prefix {
            (0, i + 1)
        } else {
            let branch = (i - self.prefix) / self.tail;
            let start = self.prefix + branch * self.tail;
            (start, self.prefix + (i - start) + 1)
        };
        let prefix = self.prefix;
        let key = move |j: usize| {
            if j < prefix {
                j
            } else {
                branch_start + (j - prefix)
            }
        };
        (len, key)
    }

    /// Sequence-major values (`width` per position, `[S·T, width]`) into layout rows; a shared row
    /// takes its group's first sequence's values (the rest are equal by construction).
    pub fn pack<T: Copy + Default>(&self, seq_major: &[T], width: usize) -> Vec<T> {
        let t = self.seq_len();
        assert_eq!(seq_major.len(), self.sequences() * t * width, "pack");
        let mut out = vec![T::default(); self.rows() * width];
        for s in (0..self.sequences()).rev() {
            for p in 0..t {
                out[self.row(s, p) * width..][..width]
                    .copy_from_slice(&seq_major[(s * t + p) * width..][..width]);
            }
        }
        out
    }

    /// Layout rows (`width` values each) back to sequence-major order, shared rows copied into every
    /// sequence of their group.
    pub fn unpack<T: Copy + Default>(&self, rows: &[T], width: usize) -> Vec<T> {
        let t = self.seq_len();
        assert_eq!(rows.len(), self.rows() * width, "unpack");
        let mut out = vec![T::default(); self.sequences() * t * width];
        for s in 0..self.sequences() {
            for p in 0..t {
                out[(s * t + p) * width..][..width]
                    .copy_from_slice(&rows[self.row(s, p) * width..][..width]);
            }
        }
        out
    }

    /// The adjoint of [`Layout::unpack`]: sums sequence-major gradients into layout rows, in sequence
    /// order (a fixed order, so the bits never depend on threads).
    pub fn fold(&self, seq_major: &[f32], width: usize) -> Vec<f32> {
        let t = self.seq_len();
        assert_eq!(seq_major.len(), self.sequences() * t * width, "fold");
        let mut out = vec![0.0f32; self.rows() * width];
        for s in 0..self.sequences() {
            for p in 0..t {
                out[self.row(s, p) * width..][..width]
                    .iter_mut()
                    .zip(&seq_major[(s * t + p) * width..][..width])
                    .for_each(|(o, &g)| *o += g);
            }
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
        let l = Layout::shared_prefix(&toks, 6, 4, 3, 2);
        assert_eq!((l.groups, l.prefix, l.branches, l.tail), (2, 2, 3, 2));
        assert_eq!((l.rows(), l.sequences(), l.seq_len()), (16, 6, 4));
        let mut bad = toks.clone();
        bad[4] = 9; // sequence 1 of group 0 has another prompt
        assert_eq!(Layout::shared_prefix(&bad, 6, 4, 3, 2), Layout::plain(6, 4));
        assert_eq!(
            Layout::shared_prefix(&toks, 6, 4, 4, 2),
            Layout::plain(6, 4)
        );
        assert_eq!(
            Layout::shared_prefix(&toks, 6, 4, 1, 2),
            Layout::plain(6, 4)
        );
    }

    #[test]
    fn rows_positions_and_contexts_agree() {
        let l = Layout {
            groups: 2,
            prefix: 3,
            branches: 2,
            tail: 2,
        };
        // Group rows: p0 p1 p2 | a3 a4 | b3 b4.
        assert_eq!(l.row(1, 4), 6);
        assert_eq!(l.row(2, 1), 8);
        assert_eq!(l.row(3, 3), 12);
        for s in 0..4 {
            for p in 0..5 {
                let r = l.row(s, p);
                assert_eq!(l.position(r), p);
                let (len, key) = l.context(r % l.group_rows());
                assert_eq!(len, p + 1);
                // Key j is the row of position j of the same sequence.
                for j in 0..len {
                    assert_eq!(key(j), l.row(s, j) % l.group_rows(), "s {s} p {p} j {j}");
                }
            }
        }
        let plain = Layout::plain(3, 4);
        assert_eq!(
            (plain.rows(), plain.row(2, 1), plain.position(9)),
            (12, 9, 1)
        );
        assert_eq!(plain.context(2).0, 3);
    }

    #[test]
    fn pack_unpack_fold_round_trip() {
        let toks = tokens_of(&[[1, 2], [3, 4]], 3, &[10, 20]);
        let l = Layout::shared_prefix(&toks, 6, 4, 3, 2);
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
