"""tools/plot_run.py and the shared log parser: logs written by the training logger (and a line in
Megatron-LM's own format) parse back to the numbers logged; two runs are drawn overlaid into a
non-trivial PNG."""

import math
import os
import subprocess
import sys

import numpy as np
from PIL import Image

from pretrain.training.report.log_parse import parse_iteration_lines, read_run_log
from pretrain.training.report.logging import (
    IterationStats,
    banner,
    format_eval_line,
    format_iteration_line,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAB10_BLUE, TAB10_ORANGE = (31, 119, 180), (255, 127, 14)


def stats(it, loss, lr, gbs=8):
    return IterationStats(
        iteration=it, train_iters=100, consumed_samples=it * gbs, elapsed_ms=900.0,
        learning_rate=lr, global_batch_size=gbs, lm_loss=loss, loss_scale=1.0,
        grad_norm=2.0 / it, skipped_iterations=0, nan_iterations=0,
        tokens_per_second=4000.0 + it, tflops_per_device=0.01, mfu=None,
    )  # fmt: skip


def write_log(path, iterations, offset=0.0):
    lines = [
        banner(
            tp=2,
            pp=2,
            dp=1,
            sharding="ZeRO-0",
            world=4,
            launcher="deepspeed",
            backend="gloo",
            device="cpu",
            params_total=1000,
            tokens_per_iteration=8 * 64,
            global_batch=8,
            micro_batch=4,
            num_microbatches=2,
            precision="fp32",
            save=None,
            load=None,
            flops_per_iteration=1.0,
            threads=1,
        )  # fmt: skip
    ]
    for it in iterations:
        lines.append(format_iteration_line(stats(it, 8.0 / math.sqrt(it) + offset, 1e-3 / it)))
        if it % 50 == 0:
            lines.append(format_eval_line(it, 7.5 / math.sqrt(it) + offset))
    # after the last iteration: Megatron's final validation and test blocks
    lines.append(format_eval_line(it, 7.4 / math.sqrt(it) + offset, " on validation set"))
    lines.append(format_eval_line(it, 9.9, " on test set"))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parser_reads_what_the_logger_wrote(tmp_path):
    run = read_run_log(write_log(tmp_path / "a.log", range(10, 101, 10)))
    assert run.seq_length == 64
    its, losses = run.series("lm loss")
    assert its == list(range(10, 101, 10))
    assert np.allclose(losses, [8.0 / math.sqrt(i) for i in its], rtol=1e-6)
    assert run.series("grad norm")[1] == [round(2.0 / i, 3) for i in its]
    final = float(f"{7.4 / math.sqrt(100):.6E}")  # the end-of-training one replaces iteration 100's
    assert run.validation == [(50, float(f"{7.5 / math.sqrt(50):.6E}")), (100, final)]
    assert run.tokens_at([10, 100]) == [10 * 8 * 64, 100 * 8 * 64]


def test_parser_keeps_each_validation_set_apart(tmp_path):
    log = write_log(tmp_path / "a.log", range(10, 101, 10))
    extra = [format_eval_line(it, 3.0 + it / 100, suffix="-wiki") for it in (50, 100)]
    extra.append(format_eval_line(100, 4.0, " on validation set", suffix="-code"))
    log.write_text(log.read_text() + "\n".join(extra) + "\n")
    run = read_run_log(log)
    assert run.validation_sets == {"wiki": [(50, 3.5), (100, 4.0)], "code": [(100, 4.0)]}
    assert [v[0] for v in run.validation] == [50, 100]  # the unsuffixed line stays its own
    out = tmp_path / "sets.png"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), "--log", str(log), "--out",
         str(out)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10_000


def test_parser_reads_a_megatron_lm_line():
    # Megatron-LM's own line: no tokens/s, TFLOP/s after the elapsed time
    line = (
        " [2024-05-01 10:00:00] iteration      200/   10000 | consumed samples:        51200 | "
        "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 150.2 | "
        "learning rate: 2.999000E-04 | global batch size:   256 | lm loss: 5.123456E+00 | "
        "loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |"
    )
    (row,) = parse_iteration_lines(line.replace(" [2024-05-01 10:00:00]", ""))
    assert row["iteration"] == "200" and row["train_iters"] == "10000"
    assert float(row["lm loss"]) == 5.123456 and float(row["learning rate"]) == 2.999e-4
    assert row["consumed samples"] == "51200" and row["grad norm"] == "1.234"


def test_two_runs_overlaid_into_a_png(tmp_path):
    a = write_log(tmp_path / "tp2pp2.log", range(10, 101, 10))
    b = write_log(tmp_path / "resume.log", range(60, 151, 10), offset=0.3)
    out = tmp_path / "curves.png"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), "--log", str(a), "--log", str(b),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"wrote {out} (2 run(s))" in r.stdout
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape[0] >= 500 and image.shape[1] >= 1200
    colours = {tuple(c) for c in np.unique(image.reshape(-1, 3), axis=0)}
    assert len(colours) > 50  # lines, text, antialiasing: not a blank canvas
    assert TAB10_BLUE in colours and TAB10_ORANGE in colours  # both runs are drawn
    blue = np.all(image == TAB10_BLUE, axis=-1)
    assert blue.sum() > 500  # real curves, not a legend swatch only


def test_log_without_iteration_lines_is_one_line_error(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), "--log", str(empty),
         "--out", str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "no Megatron-format iteration lines" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_tokens_per_source_are_parsed_and_drawn(tmp_path):
    """A blend's `consumed tokens <prefix>` fields parse back per source, and the figure gets a
    third row for them (taller than a run without them)."""
    import dataclasses
    import importlib.util

    plain = write_log(tmp_path / "plain.log", range(10, 51, 10))
    lines = []
    for it in range(10, 51, 10):
        read = {"/data/web": 64 * it, "/data/code": 64 * min(it, 20)}  # code dropped at 20
        lines.append(
            format_iteration_line(dataclasses.replace(stats(it, 3.0, 1e-3), source_tokens=read))
        )
    mixed = tmp_path / "mixed.log"
    mixed.write_text(plain.read_text() + "\n".join(lines) + "\n")
    run = read_run_log(mixed)
    assert run.sources() == {
        "/data/web": ([10, 20, 30, 40, 50], [640.0, 1280.0, 1920.0, 2560.0, 3200.0]),
        "/data/code": ([10, 20, 30, 40, 50], [640.0, 1280.0, 1280.0, 1280.0, 1280.0]),
    }
    assert read_run_log(plain).sources() == {}
    spec = importlib.util.spec_from_file_location(
        "plot_run", os.path.join(ROOT, "tools", "plot_run.py")
    )
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    heights = []
    for log in (plain, mixed):
        out = tmp_path / f"{log.stem}.png"
        plot_run.plot_runs([read_run_log(log)], ["run"], str(out))
        heights.append(np.asarray(Image.open(out)).shape[0])
    assert heights[1] >= heights[0] * 1.4
