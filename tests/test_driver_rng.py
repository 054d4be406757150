"""driver/rng.py: the generators' fingerprint needs no numpy (not a dependency of ours
nor of torch's wheel), and tells different generator states apart."""

from __future__ import annotations

import subprocess
import sys

import torch

from spmd_compiler.driver.rng import RngSync

_NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # an install without numpy: importing it raises
import warnings
warnings.simplefilter("ignore")
import torch
from spmd_compiler.driver.rng import RngSync
torch.manual_seed(5)
print(RngSync(None, False).fingerprint())
"""


def test_fingerprint_without_numpy_equals_the_one_with_it():
    out = subprocess.run([sys.executable, "-c", _NO_NUMPY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    torch.manual_seed(5)
    assert out.stdout.strip() == str(RngSync(None, False).fingerprint())


def test_fingerprint_tells_states_apart_and_agrees_on_equal_ones():
    sync = RngSync(None, False)
    torch.manual_seed(5)
    a = sync.fingerprint()
    torch.manual_seed(5)
    assert sync.fingerprint() == a and sync.agree([a[0], a[1]])
    torch.rand(3)
    b = sync.fingerprint()
    assert b != a
    assert not sync.agree([max(a[0], b[0]), max(a[1], b[1])])  # the MAX over two ranks that differ
