#!/usr/bin/env python3
"""Symbolizes sampler.c's stacks against the unstripped binary they came from and prints where the
host's CPU time went: by thread, by leaf (a library or a function), by the innermost function of
the binary and of lockstep's own (alone and with its caller), and inclusive by lockstep function.

    report.py SAMPLES BINARY [--top N] [--module NAME] [--focus FUNCTION] [--exclude PATH ...]

SAMPLES is the file sampler.c wrote (its .maps beside it); BINARY the same build, not stripped
(stripping keeps the addresses). Each sample is a millisecond of one thread's CPU time."""
import argparse, bisect, collections, os, struct, subprocess


def read_samples(path):
    data = open(path, "rb").read()
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    i = 0
    while i + 2 <= len(words):
        tid, n = words[i], words[i + 1]
        if n == 0 or i + 2 + n > len(words):
            break
        yield tid, words[i + 2 : i + 2 + n]
        i += 2 + n


def read_maps(path):
    """(start, end, file offset, path) of each file mapping; and each file's load base."""
    maps, base = [], {}
    for line in open(path):
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        off, name = int(parts[2], 16), parts[5].strip()
        maps.append((lo, hi, off, name))
        if off == 0 and name not in base:
            base[name] = lo
    maps.sort()
    return maps, base


def symbolize(binary, addrs):
    """Function name of each address of `binary` (addresses relative to its load base)."""
    if not addrs:
        return {}
    text = "\n".join(hex(a) for a in addrs) + "\n"
    out = subprocess.run(["addr2line", "-f", "-C", "-e", binary], input=text,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    names = {}
    for a, i in zip(addrs, range(0, len(out), 2)):
        names[a] = out[i]
    return names


def main():
    p = argparse.ArgumentParser()
    p.add_argument("samples")
    p.add_argument("binary")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--module", default=None,
                   help="the binary's file name in the run (default: BINARY's own name)")
    p.add_argument("--focus", default=None, help="only samples whose stack holds this function")
    p.add_argument("--exclude", action="append", default=[],
                   help="drop samples with a frame in a file whose path holds this (repeatable)")
    a = p.parse_args()
    maps, base = read_maps(a.samples + ".maps")
    starts = [m[0] for m in maps]
    exe = a.module or os.path.basename(a.binary)

    def where(addr):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and maps[i][0] <= addr < maps[i][1]:
            return maps[i][3]
        return "?"

    def offset(k, addr):
        """`addr`'s offset in the binary (a return address, k > 0, taken back into its call), or
        None for another file's."""
        m = where(addr)
        if os.path.basename(m) != exe:
            return None
        return addr - base[m] - (1 if k > 0 else 0)

    samples = list(read_samples(a.samples))
    own = {o for _, stack in samples for k, addr in enumerate(stack)
           if (o := offset(k, addr)) is not None}
    names = symbolize(a.binary, sorted(own))

    def frames(stack):
        out = []
        for k, addr in enumerate(stack):
            o = offset(k, addr)
            out.append(names.get(o, "?") if o is not None else "[" + os.path.basename(where(addr)) + "]")
        return out

    threads, leaf, incl, first_own, first_ls, pair_ls = (collections.Counter() for _ in range(6))
    total = 0
    for tid, stack in samples:
        fr = frames(stack)[1:]  # frame 0 is the signal handler itself
        if fr and fr[0].startswith("[libc"):
            fr = fr[1:]  # the kernel's return trampoline
        if a.focus and not any(a.focus in f for f in fr):
            continue
        if a.exclude and any(x in where(addr) for x in a.exclude for addr in stack[1:]):
            continue
        total += 1
        threads[tid] += 1
        leaf[fr[0] if fr else "?"] += 1
        mine = next((f for f in fr if not f.startswith("[")), "?")
        first_own[mine] += 1
        ls = [f for f in fr if "lockstep::" in f]
        first_ls[ls[0] if ls else "?"] += 1
        pair_ls[" <- ".join(ls[:2]) if ls else "?"] += 1
        for f in set(fr):
            incl[f] += 1
    print(f"{total} samples (ms of CPU time), {len(threads)} threads")
    print("by thread:", ", ".join(f"{t}: {c}" for t, c in threads.most_common(12)))
    for title, counter in (("leaf frame (a library, or a function of the binary)", leaf),
                           ("innermost function of the binary (library time charged to its caller)", first_own),
                           ("innermost function of lockstep's own (its crates' time charged to it)", first_ls),
                           ("the same, with its caller", pair_ls),
                           ("inclusive, lockstep's functions (the function anywhere on the stack)", incl)):
        print(f"\n== {title}")
        rows = [(n, c) for n, c in counter.most_common() if counter is not incl or "lockstep" in n]
        for name, c in rows[: a.top]:
            print(f"{c:8} {100 * c / max(total, 1):5.1f}%  {name[:150]}")


if __name__ == "__main__":
    main()
