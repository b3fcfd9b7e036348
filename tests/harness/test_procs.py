"""The process harness keeps a child's errors apart from its rolling output tail."""

from __future__ import annotations

import sys

from layerswarm.harness.procs import launch


def test_errors_and_tracebacks_outlive_the_output_tail() -> None:
    script = (
        "import logging; logging.basicConfig(); logging.getLogger('x').error('boom')\n"
        "for i in range(500): print('chatter', i)\n"
        "raise SystemExit(1 / 0)"
    )
    proc = launch("noisy", [sys.executable, "-c", script])
    proc.popen.wait(30)
    while proc.lines.get(timeout=10) is not None:  # the pump has read everything
        pass
    assert not any("boom" in line for line in proc.output)  # rolled out of the 200-line tail
    assert any("boom" in line for line in proc.errors)
    assert any("ZeroDivisionError" in line for line in proc.errors)
    assert not any("chatter" in line for line in proc.errors)
