import subprocess
import sys


def test_core_imports_without_vllm_or_mooncake():
    code = (
        "import sys, kvpool, kvpool.ops.cli;"
        "bad = [m for m in ('vllm', 'mooncake', 'torch') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
