"""The fault-tolerance demo (examples/fault_tolerance_demo.py) end to end, as a
user runs it: 4 gloo ranks train with TrainPipelineSparseDist, one is killed
in a step, the 3 others recover (the lost shards from a buddy's snapshot),
rebuild the pipeline on the recovered model and finish. (The checkpoint
source and every kill point are tested in the package:
torchrec/distributed/tests/test_fault_tolerance.py.)"""

import subprocess
import sys

from conftest import REPO

DEMO = REPO / "examples" / "fault_tolerance_demo.py"


def test_three_ranks_train_on_after_one_is_killed(tmp_path: object) -> None:
    source, kill_at = "snapshot", "forward"
    done = subprocess.run(
        [
            sys.executable,
            str(DEMO),
            "--steps",
            "8",
            "--kill-step",
            "5",
            "--kill-at",
            kill_at,
            "--source",
            source,
            "--rows",
            "256",
            "--checkpoint-dir",
            str(tmp_path),
            "--pipeline",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    assert "rank 3: killed (SIGKILL)" in out, out
    assert "lost ranks [3]" in out and "members [0, 1, 2]" in out, out
    assert f"from {source}:" in out, out
    assert "step 7: loss" in out and "on [0, 1, 2]" in out, out
    assert "exit codes: [0, 0, 0, -9]" in out, out
