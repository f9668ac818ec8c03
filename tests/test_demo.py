"""The README's first command stays true: `slotkeeper demo` runs a swap on a real llama-server."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_runs_end_to_end(llama_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "SLOTKEEPER_"))}
    env.update(XDG_CACHE_HOME=str(tmp_path), LLAMA_SERVER=llama_server)
    proc = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "demo"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reused = re.search(r"tokens reused from the cache\s+([\d,]+) of ([\d,]+)", proc.stdout)
    assert reused and reused.group(1) == reused.group(2), proc.stdout
    speedup = float(re.search(r"speed-up\s+([\d.]+)x", proc.stdout).group(1))
    assert speedup > 5, proc.stdout
