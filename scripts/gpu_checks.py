#!/usr/bin/env python3
"""Checks and tables for scripts/gpu-run.sh: each subcommand prints one line,
`PASS <what> ...` or `FAIL <what> ...`, and exits 0 / 1 (tables exit 0).

  trace FILE [cpu]                the --trace output is a valid Chrome trace with the spans
                                  of copies, compute, buckets, the optimizer and the engine
                                  (`cpu`: a one-rank CPU run has no copies and no buckets)
  accuracy RUN MIN                the last valid accuracy in RUN/metrics.jsonl is >= MIN
  same-weights RUN_A RUN_B [WHAT] the two runs' model.safetensors hold the same tensors
                                  (bit-exact, else the largest difference is printed)
  eval-match RUN EVAL_LOG TOL     `birdtrain eval` (on the CPU) of RUN's checkpoint gives the
                                  run's own last valid accuracy within TOL
  data-wait LOG MAX_PERCENT       the last epoch line of a training log shows data-wait <= MAX
  bench JSONL                     ours vs the PyTorch peer per model (ms per step, ratio)
  top-kernels BENCH_JSON N        the N kernels with the most time in a --breakdown line
  fusion-bench FUSED SEPARATE MODEL  `bench step --breakdown` logs with batch norm fused into
                                  the convolutions (BIRDTRAIN_BN_FUSION=1) and separate: ms per
                                  step and their batch-norm and convolution kernels; PASS when
                                  the fused step is faster
  tests LOG PREFIX N              one line per test named PREFIX… (`module::test`) in a test
                                  binary's log (run
                                  with --show-output): PASS with the last line it printed, FAIL
                                  with its panic, or when it printed "skipped" (no GPU), never
                                  finished, or fewer than N such tests ran
  pytest LOG N                    one line per test of a `pytest -v -rfE` log (the Python
                                  package's GPU tests): PASS when it PASSED, FAIL with its
                                  error when it failed, errored or skipped; FAIL when fewer
                                  than N tests ran
  torchrun RUN LOG EPOCHS [resumed]  a run under torchrun: RUN/checkpoint.json covers EPOCHS,
                                  LOG shows a GPU run (and, with `resumed`, a worker killed and
                                  the restarted one resuming)
  sync-bn-cost LOG_SYNC LOG_PLAIN the last epoch's training images/s with --sync-bn against
                                  without (a measurement: PASS when both ran and the sync-BN
                                  run put its sums on the side communicator, on the device)
  fusion-rounds MODEL FUSED,… SEPARATE,…  `bench step` logs (no --breakdown) of rounds run in
                                  turn, fused and separate: the median ms per step of each and
                                  every round's figure; PASS when the fused median is lower
  conv3-rounds MODEL V3,… V2,…    the same for BIRDTRAIN_CONV=v3 (the Hopper kernels) against
                                  v2: PASS when the v3 median is lower (FAIL when a report
                                  names other convolutions than its setting's)
  prologue-rounds MODEL ON,… OFF,…  the same for BIRDTRAIN_BN_PROLOGUE=1 (the convolutions
                                  apply the inner batch norms) against 0: PASS when on is lower
  tiles-rounds MODEL SCHEDULE LOGS,… BLOCKS,…  the same for BIRDTRAIN_CONV3_TILES=SCHEDULE
                                  (raster or persistent) against blocks: PASS when SCHEDULE's
                                  median is lower (FAIL when a report names another schedule)
  mask-rounds MODEL SCHEDULE MASK LOGS,… STORED,…  the same for BIRDTRAIN_BN_MASK=MASK
                                  (recomputed or packed) against stored, both under
                                  BIRDTRAIN_CONV3_TILES=SCHEDULE: PASS when MASK's median is lower
  accum-cost LOG_ACCUM LOG_MICRO LOG_WHOLE  the last epoch's images/s of B × K accumulated
                                  against B alone and against one batch of B·K (a measurement:
                                  PASS when all three ran and the accumulated run said so)
  tta JSON GOAL                   the time-to-accuracy driver's OUT/tta.json
                                  (benches/fashion_mnist/run_tta.py): each side's seconds to
                                  the target test accuracy and the ratio; PASS when both
                                  reached it and the peer took at least GOAL times as long
                                  (GOAL 0: when both reached it)
Standard library only: it runs on the GPU machine's python3 and here.
"""
import json
import re
import struct
import sys


def say(ok, what, detail):
    print(f"{'PASS' if ok else 'FAIL'} {what}: {detail}", flush=True)
    return 0 if ok else 1


def trace(path, device="gpu"):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        return say(False, "trace", f"{path} is not JSON: {e}")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list) or not events:
        return say(False, "trace", "no traceEvents array")
    bad = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            bad.append(f"event {i} has no name")
            continue
        ph = e.get("ph")
        if ph not in ("X", "B", "E", "i", "I", "M", "C", "b", "e", "n", "s", "t", "f"):
            bad.append(f"event {i} ({e['name']}) has phase {ph!r}")
        if ph != "M" and not isinstance(e.get("ts"), (int, float)):
            bad.append(f"event {i} ({e['name']}) has no numeric ts")
        if ph == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            bad.append(f"event {i} ({e['name']}) has a bad dur {e.get('dur')!r}")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            bad.append(f"event {i} ({e['name']}) lacks integer pid/tid")
    names = {e["name"] for e in events if isinstance(e, dict) and "name" in e}
    wanted = ["forward + backward", "optimizer", "engine: "]
    if device != "cpu":
        wanted += ["H2D batch", "all-reduce bucket"]
    missing = [w for w in wanted if not any(w in n for n in names)]
    if bad or missing:
        return say(False, "trace", f"{'; '.join(bad[:5])} missing spans: {missing}")
    return say(True, "trace", f"{len(events)} events, spans {wanted} present")


def metrics(run):
    with open(f"{run}/metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def last_valid_accuracy(run):
    valid = [m for m in metrics(run) if m.get("split") == "valid"]
    return valid[-1]["accuracy"] if valid else None


def accuracy(run, floor):
    acc = last_valid_accuracy(run)
    if acc is None:
        return say(False, "accuracy", f"no valid line in {run}/metrics.jsonl")
    return say(acc >= float(floor), "accuracy", f"valid accuracy {acc:.4f} (bar {floor})")


def safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def same_weights(a, b, what="resume"):
    ta, tb = safetensors(f"{a}/model.safetensors"), safetensors(f"{b}/model.safetensors")
    if ta.keys() != tb.keys():
        return say(False, what, f"tensor names differ: {sorted(ta.keys() ^ tb.keys())[:5]}")
    differ = [k for k in ta if ta[k] != tb[k]]
    if not differ:
        return say(True, what, f"all {len(ta)} tensors bit-identical")
    worst, where, worst_rel, where_rel, other = 0.0, "", 0.0, "", []
    for k in differ:
        dtype, _, ra = ta[k]
        rb = tb[k][2]
        if dtype != "F32" or len(ra) != len(rb):
            other.append(f"{k} ({dtype})")
            continue
        fa = struct.unpack(f"<{len(ra) // 4}f", ra)
        fb = struct.unpack(f"<{len(rb) // 4}f", rb)
        d = max(abs(x - y) for x, y in zip(fa, fb))
        r = max(abs(x - y) / (1e-3 + abs(x)) for x, y in zip(fa, fb))
        if d > worst:
            worst, where = d, k
        if r > worst_rel:
            worst_rel, where_rel = r, k
    detail = (f"{len(differ)}/{len(ta)} tensors differ, worst f32 difference {worst:.3g} in "
              f"{where or '-'}, worst relative {worst_rel:.3g} in {where_rel or '-'}")
    if other:
        detail += f"; other tensors differing: {', '.join(other[:5])}"
    return say(False, what, detail)


def eval_match(run, log, tol):
    want = last_valid_accuracy(run)
    text = open(log).read()
    m = re.search(r"top-1 ([0-9.]+)", text)
    if want is None or not m:
        return say(False, "eval on CPU", f"no accuracy to compare (run {want}, eval {bool(m)})")
    got = float(m.group(1))
    ok = abs(got - want) <= float(tol)
    return say(ok, "eval on CPU", f"CPU top-1 {got:.4f} vs the GPU run's {want:.4f} (tolerance {tol})")


def data_wait(log, most):
    shares = re.findall(r"data-wait ([0-9.]+)%", open(log).read())
    if not shares:
        return say(False, "data-wait", f"no data-wait figure in {log}")
    # The epoch lines come first, the run's summary last: report the last epoch's (a warm
    # cache), else the run's.
    epoch_lines = [l for l in open(log) if l.startswith("epoch ") and "data-wait" in l]
    share = float(re.findall(r"data-wait ([0-9.]+)%", epoch_lines[-1])[0] if epoch_lines else shares[-1])
    return say(share <= float(most), "data-wait", f"{share}% in the last epoch (at most {most}%)")


def bench(path):
    ours, peers = {}, {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "peer" in d:
            peers[(d["model"], d["peer"])] = d
        elif "ms_per_step" in d:
            ours[d["model"]] = d
    print(f"{'model':<10} {'birdtrain ms':>12} {'peer':<14} {'peer ms':>8} {'peer/ours':>9}")
    for model, d in ours.items():
        for (m, peer), p in sorted(peers.items()):
            if m == model:
                ratio = p["ms_per_step"] / d["ms_per_step"]
                print(f"{model:<10} {d['ms_per_step']:>12.2f} {peer:<14} {p['ms_per_step']:>8.2f} {ratio:>9.2f}")
        if not any(m == model for m, _ in peers):
            print(f"{model:<10} {d['ms_per_step']:>12.2f} (no peer line)")
    return 0


def top_kernels(path, n):
    for line in open(path):
        if line.startswith("{") and '"breakdown"' in line:
            rows = json.loads(line)["breakdown"]
            rows.sort(key=lambda r: -r["ms_per_step"])
            # ncu filters by the CUDA function name: the label's first word, once each.
            names = list(dict.fromkeys(r["kernel"].split()[0] for r in rows))
            print(" ".join(names[: int(n)]))
            return 0
    return 1


def last_report(path):
    """The last `bench step --json` line of a log."""
    rows = [json.loads(l) for l in open(path) if l.startswith("{") and "ms_per_step" in l]
    if not rows:
        raise ValueError(f"no bench step JSON line in {path}")
    return rows[-1]


def fusion_bench(fused_log, separate_log, model):
    fused, separate = last_report(fused_log), last_report(separate_log)

    def kinds(report):
        """ms per step in batch-norm kernels, in convolution kernels (with their epilogues)."""
        bn = conv = 0.0
        for r in report.get("breakdown") or []:
            name = r["kernel"].split()[0]
            if name.startswith("bn_"):
                bn += r["ms_per_step"]
            elif name.startswith("conv"):
                conv += r["ms_per_step"]
        return bn, conv

    (fb, fc), (sb, sc) = kinds(fused), kinds(separate)
    f, s = fused["ms_per_step"], separate["ms_per_step"]
    detail = (f"fused {f:.2f} ms (bn kernels {fb:.2f}, convolutions {fc:.2f}) vs separate {s:.2f} ms "
              f"(bn {sb:.2f}, convolutions {sc:.2f}): {100 * (1 - f / s):.1f} % less ({fused.get('device', '?')})")
    return say(f < s, f"bn-fusion {model}", detail)


def tests(log, prefix, expected):
    """One PASS/FAIL line per test of a libtest log whose name starts with `prefix` (its full
    name in the test binary, `module::test`; a test's own `skipped NAME:` line may give the
    name without its module)."""
    text = open(log, errors="replace").read()
    verdicts = dict(re.findall(rf"^test ({re.escape(prefix)}\S*) \.\.\. (ok|FAILED|ignored)", text, re.M))
    started = re.findall(rf"^test ({re.escape(prefix)}\S*) \.\.\. ", text, re.M)
    skipped = dict(re.findall(r"^skipped (\S+?): (.*)$", text, re.M))

    def block(name):
        """What the test printed (--show-output: its successes / failures section)."""
        m = re.search(rf"^---- {re.escape(name)} stdout ----\n(.*?)(?=^---- |^successes:|^failures:|\Z)",
                      text, re.M | re.S)
        return [l for l in (m.group(1).splitlines() if m else []) if l.strip()]

    def nocapture(name):
        """With --nocapture the test's output follows its `test NAME ... ` on the same and the
        next lines, and the verdict comes alone at the end: (verdict, those lines)."""
        m = re.search(rf"^test {re.escape(name)} \.\.\. (.*?)(?=^test |^failures:|^successes:|\Z)",
                      text, re.M | re.S)
        lines = [l for l in (m.group(1).splitlines() if m else []) if l.strip()]
        ends = [v.group(1) for l in lines if (v := re.search(r"(?:^|\s)(ok|FAILED|ignored)\s*$", l))]
        return (ends[-1] if ends else None), [l for l in lines if l.strip() not in ("ok", "FAILED")]

    rc = 0
    for name in dict.fromkeys(started):
        verdict, lines = verdicts.get(name), block(name)
        if verdict is None:
            verdict, lines = nocapture(name)
        skip = skipped.get(name, skipped.get(name.rsplit("::", 1)[-1]))
        if verdict is None:
            rc |= say(False, name, "did not finish (timed out or crashed; see the log)")
        elif skip is not None:
            rc |= say(False, name, f"skipped: {skip[:160]}")
        elif verdict == "ok":
            rc |= say(True, name, lines[-1] if lines else "ok")
        elif verdict == "ignored":
            rc |= say(False, name, "ignored (run the binary with --ignored)")
        else:
            panic = next((lines[i + 1] for i, l in enumerate(lines)
                          if "panicked at" in l and i + 1 < len(lines)), "failed (see the log)")
            rc |= say(False, name, panic[:300])
            # A test that keeps going past failures (tests/gpu/mismatch.rs) lists each one as
            # a `FAIL what [kernels]: pattern` line of its panic message: the first ones too.
            details = [l for l in (block(name) or lines) if l.startswith("FAIL ")]
            for detail in details[:16]:
                print(f"  {detail[:400]}", flush=True)
            if len(details) > 16:
                print(f"  … and {len(details) - 16} more (see the log)", flush=True)
    ran = len(dict.fromkeys(started))
    if ran < int(expected):
        rc |= say(False, f"{prefix}*", f"only {ran} of {expected} tests ran (see {log})")
    return rc


def pytest(log, expected):
    """One PASS/FAIL line per test of a verbose pytest log."""
    text = open(log, errors="replace").read()
    verdicts = dict(re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M))
    reasons = dict((name, why) for _, name, why in
                   re.findall(r"^(FAILED|ERROR) (\S+::\S+) - (.*)$", text, re.M))
    rc = 0
    for name, verdict in verdicts.items():
        short = name.split("/")[-1]
        if verdict == "PASSED":
            rc |= say(True, short, "passed")
        else:
            rc |= say(False, short, f"{verdict.lower()}: {reasons.get(name, 'see the log')[:300]}")
    if len(verdicts) < int(expected):
        tail = (text.strip().splitlines() or ["(empty log)"])[-1]
        rc |= say(False, "pytest", f"only {len(verdicts)} of {expected} tests ran ({tail[:200]}; see {log})")
    return rc


def torchrun(run, log, epochs, resumed=None):
    what = "torchrun-restart" if resumed else "torchrun"
    try:
        meta = json.load(open(f"{run}/checkpoint.json"))
    except (OSError, ValueError) as e:
        return say(False, what, f"no readable {run}/checkpoint.json ({e})")
    text = open(log, errors="replace").read()
    problems = []
    if meta.get("epoch") != int(epochs):
        problems.append(f"the checkpoint covers {meta.get('epoch')} epochs, not {epochs}")
    if not re.search(r"device .*GPU", text):
        problems.append("no GPU device line in the log (trained on the CPU?)")
    if resumed:
        if "kill -9 of worker" not in text:
            problems.append("no worker was killed")
        if "resuming" not in text:
            problems.append("the restarted worker did not say it was resuming")
    if problems:
        return say(False, what, "; ".join(problems))
    done = f"{epochs} epochs in {run}"
    return say(True, what, f"{done}, a worker killed after its first checkpoint and resumed by torchrun's restart" if resumed else done)


def last_epoch_rate(log):
    rates = [float(m) for l in open(log) if l.startswith("epoch ")
             for m in re.findall(r"([0-9.]+) images/s", l)]
    return rates[-1] if rates else None


def sync_bn_cost(log_sync, log_plain):
    synced, plain = last_epoch_rate(log_sync), last_epoch_rate(log_plain)
    if synced is None or plain is None:
        return say(False, "sync-bn-cost", f"no epoch line with images/s in {log_sync if synced is None else log_plain}")
    text = open(log_sync).read()
    if "sync-BN sums on a communicator and stream of their own" not in text:
        return say(False, "sync-bn-cost", f"{log_sync} does not say its BN sums ran on the side communicator")
    return say(True, "sync-bn-cost", f"{synced:.0f} images/s with --sync-bn, {plain:.0f} without "
               f"(x{synced / plain:.3f}, last epoch)")


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def fusion_rounds(model, fused_logs, separate_logs):
    fused = [last_report(p)["ms_per_step"] for p in fused_logs.split(",")]
    separate = [last_report(p)["ms_per_step"] for p in separate_logs.split(",")]
    f, s = median(fused), median(separate)
    rounds = "; ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(fused, separate))
    device = last_report(fused_logs.split(",")[0]).get("device", "?")
    return say(f < s, f"bn-fusion-timing {model}",
               f"median fused {f:.2f} ms vs separate {s:.2f} ms a step ({100 * (1 - f / s):.1f} % less; "
               f"rounds fused/separate {rounds}; {device})")


def paired_rounds(what, model, names, a_logs, b_logs):
    """The median ms per step of two settings' alternating rounds: PASS when the first's is lower."""
    a_ms = [last_report(p)["ms_per_step"] for p in a_logs.split(",")]
    b_ms = [last_report(p)["ms_per_step"] for p in b_logs.split(",")]
    a, b = median(a_ms), median(b_ms)
    rounds = "; ".join(f"{x:.2f}/{y:.2f}" for x, y in zip(a_ms, b_ms))
    device = last_report(a_logs.split(",")[0]).get("device", "?")
    first, second = names
    return say(a < b, f"{what} {model}",
               f"median {first} {a:.2f} ms vs {second} {b:.2f} ms a step (x{b / a:.3f}; "
               f"rounds {first}/{second} {rounds}; {device})")


def setting_not_taken(field, expected):
    """The first report of `expected` ((comma-separated logs, wanted value) pairs) whose `field`
    is not the value its setting asked for, as a sentence; None when every setting took (a
    round whose setting did not take is no timing)."""
    for logs, want in expected:
        for p in logs.split(","):
            got = last_report(p).get(field)
            if got != want:
                return f"{p} ran {field} {got!r}, not {want!r}"
    return None


def conv3_rounds(model, v3_logs, v2_logs):
    # v3 asked of a GPU without it runs v2.
    wrong = setting_not_taken("convolutions", ((v3_logs, "v3"), (v2_logs, "v2")))
    if wrong:
        return say(False, f"conv3-timing {model}", wrong)
    return paired_rounds("conv3-timing", model, ("v3", "v2"), v3_logs, v2_logs)


def tiles_rounds(model, schedule, logs, blocks_logs):
    wrong = setting_not_taken("conv3_tiles", ((logs, schedule), (blocks_logs, "blocks")))
    if wrong:
        return say(False, f"tiles-timing {model} {schedule}", wrong)
    return paired_rounds(f"tiles-timing {schedule}", model, (schedule, "blocks"), logs, blocks_logs)


def mask_rounds(model, schedule, mask, mask_logs, stored_logs):
    wrong = setting_not_taken("conv3_tiles", ((mask_logs, schedule), (stored_logs, schedule))) \
        or setting_not_taken("bn_mask", ((mask_logs, mask), (stored_logs, "stored")))
    if wrong:
        return say(False, f"mask-timing {model} {schedule} {mask}", wrong)
    return paired_rounds(f"mask-timing {schedule}", model, (mask, "stored"), mask_logs, stored_logs)


def prologue_rounds(model, on_logs, off_logs):
    wrong = setting_not_taken("batch_norm", ((on_logs, "applied"), (off_logs, "fused")))
    if wrong:
        return say(False, f"prologue-timing {model}", wrong)
    return paired_rounds("prologue-timing", model, ("applied", "stored"), on_logs, off_logs)


def accum_cost(log_accum, log_micro, log_whole):
    rates = [last_epoch_rate(p) for p in (log_accum, log_micro, log_whole)]
    if any(r is None for r in rates):
        return say(False, "accum-cost", "no epoch line with images/s in one of the three logs")
    if "accumulated" not in open(log_accum).read():
        return say(False, "accum-cost", f"{log_accum} does not say it accumulated")
    a, m, w = rates
    return say(True, "accum-cost", f"{a:.0f} images/s accumulated, {m:.0f} with the micro-batch alone "
               f"(x{a / m:.3f}), {w:.0f} with one batch of the same size (x{a / w:.3f}), last epoch")


def tta(path, goal):
    with open(path) as f:
        doc = json.load(f)
    parts = []
    for side in doc["sides"]:
        r = side["reached"]
        if r:
            parts.append(f"{side['side']} {r['wall_seconds']:.1f} s (epoch {r['epoch']}, "
                         f"accuracy {r['valid_accuracy']:.4f})")
        else:
            best = max((e["valid_accuracy"] for e in side["epochs"]), default=0.0)
            parts.append(f"{side['side']} not reached in {len(side['epochs'])} epochs "
                         f"(best {best:.4f}{', timed out' if side['timed_out'] else ''})")
    ratio = doc.get("ratio")
    detail = f"to test accuracy {doc['target']}: " + "; ".join(parts)
    if ratio is not None:
        detail += f"; ratio {ratio:.2f}x (goal >= {float(goal):g}x)"
    start = next((side.get("start") for side in doc["sides"] if side.get("start")), None)
    if start:
        detail += f"; {start.get('gpu') or start.get('device')}, torch {start.get('torch')}"
    check = doc.get("cross_check")
    if check:
        detail += (f"; birdtrain's best epoch in the peer's model: {check['peer_accuracy']:.4f} "
                   f"(its own {check['birdtrain_accuracy']:.4f})")
    ok = ratio is not None and ratio >= float(goal)
    return say(ok, "tta", detail)


def main(argv):
    commands = {
        "trace": (trace, (1, 2)), "accuracy": (accuracy, (2,)),
        "same-weights": (same_weights, (2, 3)), "eval-match": (eval_match, (3,)),
        "data-wait": (data_wait, (2,)), "bench": (bench, (1,)), "top-kernels": (top_kernels, (2,)),
        "tests": (tests, (3,)), "pytest": (pytest, (2,)), "torchrun": (torchrun, (3, 4)),
        "sync-bn-cost": (sync_bn_cost, (2,)), "fusion-bench": (fusion_bench, (3,)),
        "fusion-rounds": (fusion_rounds, (3,)), "accum-cost": (accum_cost, (3,)),
        "conv3-rounds": (conv3_rounds, (3,)), "prologue-rounds": (prologue_rounds, (3,)),
        "tiles-rounds": (tiles_rounds, (4,)),
        "mask-rounds": (mask_rounds, (5,)),
        "tta": (tta, (2,)),
    }
    if len(argv) < 2 or argv[1] not in commands or len(argv) - 2 not in commands[argv[1]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return commands[argv[1]][0](*argv[2:])
    except (OSError, ValueError, KeyError, IndexError) as e:
        return say(False, argv[1], f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
