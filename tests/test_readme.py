"""The README's examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- example:{marker} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README has no example block {marker!r}"
    return match.group(1)


def test_torchrl_loop_example_runs(capsys):
    namespace: dict = {}
    exec(compile(_block("torchrl"), "README.md", "exec"), namespace)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("loss")]
    assert len(lines) == 3  # three batches of 400 frames
    loss = namespace["loss"]
    assert loss.isfinite() and namespace["metrics"]["approx_kl"].isfinite()
