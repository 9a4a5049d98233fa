"""Without Triton the package still imports and every public function takes its reference."""

import subprocess
import sys
import textwrap


def test_package_works_without_triton():
    code = textwrap.dedent("""
        import os, sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        os.environ["TRITON_INTERPRET"] = "1"  # would pick the kernels if Triton were there
        import torch, torch.nn.functional as F
        from slidedp.backend.kernels import _triton, grad_pack, linear_cross_entropy as lce
        assert not _triton.triton_available() and not _triton.use_triton(torch.zeros(1))
        torch.manual_seed(0)
        h, w = torch.randn(9, 6), torch.randn(20, 6)
        y = torch.randint(0, 20, (9,)); y[2] = -100
        got = lce.linear_cross_entropy(h, w, y, chunk_tokens=4)
        want = F.cross_entropy(h @ w.T, y, ignore_index=-100, reduction="sum")
        assert torch.allclose(got.loss, want, rtol=1e-5), (got.loss, want)
        out = torch.zeros(12)
        stats = grad_pack.pack_grads([torch.ones(3, 2), None], [(0, 6), (6, 6)], out, [(0, 12)], scale=2.0)
        assert out.tolist() == [2.0] * 6 + [0.0] * 6 and stats.sumsq.tolist() == [24.0]
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
