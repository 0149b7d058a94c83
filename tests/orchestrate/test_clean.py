"""``pipeline clean RUN_DIR``: says what it removes and how much, refuses a folder that is not a run
folder or that a running process still uses, and ``--keep-weights`` keeps the exported weights."""

from __future__ import annotations

import subprocess
import sys

from pipeline.orchestrate.clean import disk_usage, human, users_of
from pipeline.testing.waiting import wait_for


def _run_dir(tmp_path):
    run = tmp_path / "run"
    for sub, size in (("logs/proxy.log", 10), ("checkpoints/step-1/model.pt", 3000), ("weights/v1/model.safetensors", 2000),
                      ("broker/data.bin", 500)):
        f = run / sub
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * size)
    return run


def _clean(*args):
    return subprocess.run([sys.executable, "-m", "pipeline", "clean", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_sizes_are_counted_from_the_files():
    assert human(999) == "999 B" and human(1500) == "1.5 kB" and human(4_600_000_000) == "4.6 GB"


def test_dry_run_then_clean_frees_exactly_the_files(tmp_path):
    run = _run_dir(tmp_path)
    assert disk_usage(run) == 5510
    out = _clean(run, "--dry-run")
    assert out.returncode == 0 and "would free 5.5 kB" in out.stdout and run.exists()
    out = _clean(run)
    assert out.returncode == 0 and "freed 5.5 kB" in out.stdout, out.stderr
    assert not run.exists()


def test_keep_weights_keeps_only_the_exports(tmp_path):
    run = _run_dir(tmp_path)
    out = _clean(run, "--keep-weights")
    assert out.returncode == 0 and "freed 3.5 kB" in out.stdout
    assert sorted(p.name for p in run.iterdir()) == ["weights"] and disk_usage(run) == 2000


def test_refuses_what_is_not_a_run_folder_or_is_in_use(tmp_path):
    other = tmp_path / "home"
    (other / "notes").mkdir(parents=True)
    out = _clean(other)
    assert out.returncode == 2 and "not a run folder" in out.stderr and (other / "notes").exists()
    run = _run_dir(tmp_path)
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run.resolve())])
    try:
        wait_for(lambda: user.pid in users_of(run))  # /proc shows its command line once exec is done
        out = _clean(run)
        assert out.returncode == 1 and "in use" in out.stderr and str(user.pid) in out.stderr
        assert disk_usage(run) == 5510
    finally:
        user.kill()
        user.wait()
