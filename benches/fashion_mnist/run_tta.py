#!/usr/bin/env python3
"""Time to accuracy on Fashion-MNIST: birdtrain against the PyTorch peer, on one machine.

Runs birdtrain (resnet20 at 32 px, the recipe below) and then torch_fashion.py (the same
model and recipe in PyTorch) on the image folder convert.py writes, one after the other, and
reads each side's per-epoch test accuracy as it is printed (birdtrain's epoch lines, the
peer's JSON lines), timing every epoch end on this script's clock from the moment the side's
command was started. Prints one line per side, the seconds to the end of the first epoch
whose test accuracy is >= --target (or "not reached in N epochs" with the best accuracy), and
the ratio peer / birdtrain; then evaluates birdtrain's best epoch with the peer's model and
transforms (a cross-check that both sides build the same network and images: the accuracies
agree within rounding, bf16 on a GPU). Writes every epoch and the result to OUT/tta.json.

The recipe, the same on both sides (flags below): resnet20, --image-size 32 (the 28 px images
resized bilinearly), --augment pad-crop (shift by up to 4 px, zero padding in normalised
space, and mirror), SGD momentum 0.9 Nesterov, weight decay 5e-4 (not on batch norm or
biases), --lr for a global batch of 256 scaled linearly, --warmup-epochs of linear warm-up then
a half cosine to 0 over --epochs, no label smoothing, --seed.

birdtrain starts with an empty pixel cache (OUT/cache, removed first), so its first epoch
decodes every PNG, as the peer's DataLoader does every epoch.

On the GPU machine (after convert.py; see README.md):
  python3 benches/fashion_mnist/run_tta.py --bin .gpu/birdtrain --data /tmp/fmnist --gpus 1 \
      --epochs 12 --batch-size 256 --lr 0.2 --stop-at-target --out /tmp/tta --time-limit 420
On the CPU, a smoke test of the whole script at a small scale (the peer without compile or AMP):
  python3 benches/fashion_mnist/convert.py --dest /tmp/fm-small --limit 50
  /usr/bin/python3 benches/fashion_mnist/run_tta.py --bin target/release/birdtrain \
      --data /tmp/fm-small --gpus 0 --epochs 2 --batch-size 64 --workers 1 --threads 1 \
      --target 0.5 --out /tmp/tta-smoke
With --stop-at-target each side is ended (SIGTERM) once an epoch reaches the target, which
saves device time and changes no figure. Exit status: 0 when every side ran to its last
epoch or to the target (whether or not it reached it), 1 when a side failed or was stopped by
the time limit, 2 for bad arguments.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# birdtrain's epoch line (src/train/epoch_end.rs).
EPOCH_LINE = re.compile(
    r"^epoch (\d+)/(\d+) · train loss (\S+) acc (\S+) · valid loss (\S+) acc (\S+) top-5 (\S+) · "
    r"(\S+) images/s")


def recipe_flags(a):
    """The recipe's birdtrain flags (the peer takes the same values under its own names)."""
    return ["--model", "resnet20", "--image-size", "32", "--epochs", str(a.epochs),
            "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--optimizer", "sgd",
            "--momentum", "0.9", "--nesterov", "true", "--weight-decay", "5e-4",
            "--warmup-epochs", str(a.warmup_epochs), "--schedule", "cosine",
            "--augment", "pad-crop", "--label-smoothing", "0", "--seed", str(a.seed)]


def birdtrain_command(a):
    run = os.path.join(a.out, "birdtrain-run")
    cmd = [a.bin, "--data", a.data, "--gpus", str(a.gpus), "--out", run, "--overwrite",
           "--cache-dir", os.path.join(a.out, "cache"), "--quiet"] + recipe_flags(a)
    if a.workers is not None:
        cmd += ["--workers", str(a.workers)]
    if a.threads is not None and a.gpus == 0:
        cmd += ["--threads", str(a.threads)]
    return cmd


def peer_command(a):
    cmd = [a.python, os.path.join(HERE, "torch_fashion.py"), "--data", a.data,
           "--model", "resnet20", "--image-size", "32", "--epochs", str(a.epochs),
           "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--momentum", "0.9",
           "--nesterov", "true", "--weight-decay", "5e-4", "--warmup-epochs", str(a.warmup_epochs),
           "--label-smoothing", "0", "--seed", str(a.seed),
           "--device", "cpu" if a.gpus == 0 else "cuda"]
    if a.workers is not None:
        cmd += ["--workers", str(a.workers)]
    if a.threads is not None and a.gpus == 0:
        cmd += ["--threads", str(a.threads)]
    if a.no_compile:
        cmd += ["--no-compile"]
    return cmd


def cross_check(a, bird):
    """birdtrain's best epoch (RUN/best/, kept whether or not the side was stopped early)
    evaluated by the peer's model and transforms: the same test accuracy (within bf16 on a
    GPU) shows that the two sides build the same network and the same images."""
    weights = os.path.join(a.out, "birdtrain-run", "best", "model.safetensors")
    best = max(bird["epochs"], key=lambda e: e["valid_accuracy"], default=None)
    if best is None or not os.path.exists(weights):
        return None, "cross-check: skipped (birdtrain finished no epoch)"
    cmd = peer_command(a) + ["--eval-weights", weights]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rec = parse_last_json(done.stdout)
    if done.returncode != 0 or rec is None or "valid_accuracy" not in rec:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"cross-check: FAILED to evaluate {weights}: {tail[0]}"
    diff = abs(rec["valid_accuracy"] - best["valid_accuracy"])
    return ({"peer_accuracy": rec["valid_accuracy"], "birdtrain_accuracy": best["valid_accuracy"],
             "epoch": best["epoch"], "difference": round(diff, 4)},
            f"cross-check: birdtrain's best epoch ({best['epoch']}) in the peer's model and "
            f"transforms: test accuracy {rec['valid_accuracy']:.4f} (birdtrain's own "
            f"{best['valid_accuracy']:.4f}, difference {diff:.4f})")


def peer_start(log_path):
    """The peer's first JSON line (device, GPU name, torch version, steps per epoch)."""
    with open(log_path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("start"):
                return rec
    return None


def parse_last_json(text):
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def parse_birdtrain(line):
    m = EPOCH_LINE.match(line)
    if not m:
        return None
    return {"epoch": int(m.group(1)), "epochs": int(m.group(2)), "train_loss": float(m.group(3)),
            "train_accuracy": float(m.group(4)), "valid_loss": float(m.group(5)),
            "valid_accuracy": float(m.group(6)), "images_per_sec": float(m.group(8))}


def parse_peer(line):
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or "epoch" not in rec:
        return None
    return {k: rec[k] for k in ("epoch", "epochs", "train_loss", "train_accuracy", "valid_loss",
                                "valid_accuracy", "images_per_sec", "seconds") if k in rec}


def run_side(name, cmd, parse, log_path, limit, target, stop_at_target):
    """Runs one side, timing its epoch lines from its start; stops it (SIGTERM to its process
    group) at `limit` seconds, or once the target is reached when `stop_at_target`."""
    epochs, reached, stopped = [], None, False
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        timed_out = False

        def on_alarm(*_):
            nonlocal timed_out
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)

        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(limit, 1))
        try:
            for line in proc.stdout:
                now = time.perf_counter() - t0
                log.write(line)
                log.flush()
                rec = parse(line.rstrip("\n"))
                if rec is None:
                    continue
                rec["wall_seconds"] = round(now, 3)
                epochs.append(rec)
                print(f"  {name} epoch {rec['epoch']}: test accuracy {rec['valid_accuracy']:.4f} "
                      f"at {now:.1f} s", flush=True)
                if reached is None and rec["valid_accuracy"] >= target:
                    reached = rec
                    if stop_at_target and rec["epoch"] < rec.get("epochs", 0):
                        stopped = True
                        os.killpg(proc.pid, signal.SIGTERM)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        rc = proc.wait()
        if timed_out or stopped:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"side": name, "command": cmd, "exit": rc, "timed_out": timed_out,
            "stopped_at_target": stopped,
            "seconds": round(time.perf_counter() - t0, 3), "epochs": epochs,
            "reached": reached, "log": log_path}


def verdict(side, target, planned):
    r = side["reached"]
    if r is not None:
        return (f"{side['side']}: test accuracy >= {target} at epoch {r['epoch']} after "
                f"{r['wall_seconds']:.1f} s (accuracy {r['valid_accuracy']:.4f})")
    best = max(side["epochs"], key=lambda e: e["valid_accuracy"], default=None)
    how = f"best {best['valid_accuracy']:.4f} at epoch {best['epoch']}" if best else "no epoch finished"
    why = ""
    if side["timed_out"]:
        why = f", stopped by the time limit after {side['seconds']:.0f} s"
    elif side["exit"] != 0:
        why = f", exit {side['exit']} (see {side['log']})"
    return (f"{side['side']}: not reached in {len(side['epochs'])} of {planned} epochs "
            f"({how}{why})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the image folder convert.py wrote")
    ap.add_argument("--bin", default="target/release/birdtrain", help="the birdtrain binary")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the peer")
    ap.add_argument("--gpus", type=int, default=1, help="birdtrain's --gpus; 0: both sides on the CPU")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.2, help="for a global batch of 256")
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, help="decode workers of both sides (default: theirs)")
    ap.add_argument("--threads", type=int, help="CPU threads of both sides (--gpus 0 only)")
    ap.add_argument("--no-compile", action="store_true", help="the peer without torch.compile")
    ap.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="end each side once it reaches the target (saves device time)")
    ap.add_argument("--no-cross-check", action="store_true",
                    help="skip evaluating birdtrain's best epoch with the peer's model")
    ap.add_argument("--sides", default="birdtrain,torch", help="which sides, in order")
    ap.add_argument("--time-limit", type=float, default=3600,
                    help="seconds for both sides together; birdtrain may take half, the peer the rest")
    ap.add_argument("--out", default="/tmp/tta", help="logs, birdtrain's run and cache, tta.json")
    a = ap.parse_args()
    sides = [s for s in a.sides.split(",") if s]
    bad = [s for s in sides if s not in ("birdtrain", "torch")]
    if bad or not sides:
        print(f"error: --sides {a.sides}: name birdtrain and/or torch", file=sys.stderr)
        return 2
    for sub in ("train", "valid"):
        if not os.path.isdir(os.path.join(a.data, sub)):
            print(f"error: {os.path.join(a.data, sub)} is not a folder: run convert.py first",
                  file=sys.stderr)
            return 2
    if "birdtrain" in sides and not os.access(a.bin, os.X_OK):
        print(f"error: {a.bin}: no birdtrain binary there (--bin)", file=sys.stderr)
        return 2
    if a.epochs < 1 or a.batch_size < 1 or not 0 < a.target <= 1:
        print("error: --epochs and --batch-size at least 1, --target in (0, 1]", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(os.path.join(a.out, "cache"), ignore_errors=True)

    start = time.perf_counter()
    results = []
    for i, name in enumerate(sides):
        left = a.time_limit - (time.perf_counter() - start)
        # The first of two sides may take half of the time; the last takes what is left.
        limit = left / 2 if i == 0 and len(sides) == 2 else left
        if name == "birdtrain":
            cmd, parse = birdtrain_command(a), parse_birdtrain
        else:
            cmd, parse = peer_command(a), parse_peer
        print(f"{name}: {' '.join(cmd)}", flush=True)
        results.append(run_side(name, cmd, parse, os.path.join(a.out, f"{name}.log"), limit,
                                a.target, a.stop_at_target))

    print()
    for side in results:
        print(verdict(side, a.target, a.epochs))
    ratio = None
    if len(results) == 2 and all(s["reached"] for s in results):
        ours, peer = (s["reached"]["wall_seconds"] for s in results)
        ratio = peer / ours
        print(f"ratio (torch seconds / birdtrain seconds to {a.target}): {ratio:.2f}x")
    elif len(results) == 2:
        print(f"ratio: none (a side did not reach {a.target})")
    peer = next((s for s in results if s["side"] == "torch"), None)
    if peer is not None:
        peer["start"] = peer_start(peer["log"])
    check = None
    bird = next((s for s in results if s["side"] == "birdtrain"), None)
    if bird is not None and not a.no_cross_check:
        check, line = cross_check(a, bird)
        print(line)
    summary = {"target": a.target, "cross_check": check, "epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr,
               "warmup_epochs": a.warmup_epochs, "gpus": a.gpus, "ratio": ratio, "sides": results}
    with open(os.path.join(a.out, "tta.json"), "w") as f:
        json.dump(summary, f, indent=1)
    ok = all(s["stopped_at_target"] or (s["exit"] == 0 and not s["timed_out"]) for s in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
