"""Build qkernels: the pure-C extension qkernels._C and, when nvcc is found, the CUDA kernels as
a separate shared object (qkernels/_qkernels_cuda.so) that _C opens at first CUDA use.

Environment:
  QKERNELS_CUDA=0         build the CPU-only extension even when nvcc is present
  QKERNELS_CUDA_ARCH      compute capabilities to compile, e.g. "90" or "80;89;90"; PTX for the
                          highest is embedded too.  Default: the GPUs nvidia-smi lists, or "90"
                          when none is visible (the build says which)
  CUDA_HOME / CUDA_PATH   the toolkit to use (else nvcc on PATH)
  QKERNELS_ASAN=1         build _C with AddressSanitizer (debug)
"""

import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg):
    print(f"qkernels: {msg}", file=sys.stderr, flush=True)


def find_nvcc():
    if os.environ.get("QKERNELS_CUDA", "1") == "0":
        return None, "QKERNELS_CUDA=0"
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc"), None
    nvcc = shutil.which("nvcc")
    return (nvcc, None) if nvcc else (None, "nvcc not found on PATH and CUDA_HOME unset")


def cudart_dirs(nvcc):
    """Directories that may hold libcudart: the toolkit's, then pip's NVIDIA wheels."""
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs += [os.path.join(os.environ[var], d) for d in ("lib64", "lib")]
    real = os.path.realpath(nvcc)
    root = os.path.dirname(os.path.dirname(real))
    dirs += [os.path.join(root, d) for d in ("lib64", "lib")]
    dirs += ["/usr/local/cuda/lib64"]
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        dirs += glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib"))
        dirs += glob.glob(os.path.join(site, "nvidia", "cu*", "lib"))
    return [d for d in dict.fromkeys(dirs) if glob.glob(os.path.join(d, "libcudart.so*"))]


def cuda_include_dirs():
    dirs = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        dirs += glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "include"))
        dirs += glob.glob(os.path.join(site, "nvidia", "cu*", "include"))
    return dirs


def cuda_archs():
    """(compute capabilities to build, why): QKERNELS_CUDA_ARCH, else the visible GPUs', else 90."""
    env = os.environ.get("QKERNELS_CUDA_ARCH")
    if env:
        return [a.strip() for a in env.replace(",", ";").split(";") if a.strip()], "QKERNELS_CUDA_ARCH"
    try:
        caps = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        caps = []
    archs = sorted({c.replace(".", "") for c in caps if c.replace(".", "").isdigit()}, key=int)
    if archs:
        return archs, "the GPUs nvidia-smi lists"
    return ["90"], "no GPU visible; QKERNELS_CUDA_ARCH='80;89;90' builds for A100, L40 and H100/H200 too"


class BuildExt(build_ext):
    def run(self):
        super().run()
        self.build_cuda()

    def build_extensions(self):
        # C11, warning-clean; the compiler is the one Python was built with.  No FP traps or errno
        # from libm are relied on, and without them the compiler may if-convert and vectorise
        # loops with float selects (the CPU kernels' inner loops); IEEE results are unchanged.
        for ext in self.extensions:
            ext.extra_compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-pthread", "-fno-trapping-math",
                                      "-fno-math-errno"] + ext.extra_compile_args
        super().build_extensions()

    def build_cuda(self):
        out_dir = os.path.dirname(self.get_ext_fullpath("qkernels._C"))
        target = os.path.join(out_dir, "_qkernels_cuda.so")
        nvcc, why = find_nvcc()
        if nvcc is None:
            log(f"building the CPU-only extension ({why}); CUDA kernels are not compiled")
            if os.path.exists(target):
                os.remove(target)
            return
        archs, why_archs = cuda_archs()
        gencode, defines = [], []
        for a in archs:
            # sm_90 machine code is built as sm_90a: the Hopper-only instructions (wgmma) of
            # attn_prefill_sm90.cu need it, and it runs on every compute capability 9.0 GPU.
            v = a + "a" if a == "90" else a
            gencode += ["-gencode", f"arch=compute_{v},code=sm_{v}"]
            if a == "90":
                defines.append("-DQK_SM90A=1")
        top = max(archs, key=int)
        gencode += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
        arch_str = " ".join(f"sm_{a}a" if a == "90" else f"sm_{a}" for a in archs) + f" +PTX(compute_{top})"
        # Objects live in the checkout's build/ folder, named by a hash of the command, the source
        # and every header, so any later build (pip's editable or regular one, setup.py) reuses them.
        obj_dir = os.path.join(HERE, "build", "cuda-objects")
        os.makedirs(obj_dir, exist_ok=True)
        includes = [f"-I{os.path.join(HERE, 'include')}"] + [f"-I{d}" for d in cuda_include_dirs()]
        sources = sorted(glob.glob(os.path.join(HERE, "kernels", "*.cu")))
        headers = sorted(glob.glob(os.path.join(HERE, "kernels", "*.cuh")) +
                         glob.glob(os.path.join(HERE, "include", "qkernels", "*.h")))
        header_digest = hashlib.sha256(b"".join(open(h, "rb").read() for h in headers)).digest()
        objects, jobs = [], []
        for src in sources:
            flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", f'-DQK_ARCHS="{arch_str}"', *defines,
                     "-lineinfo", *gencode]
            h = hashlib.sha256(header_digest + open(src, "rb").read() + " ".join(flags).encode()).hexdigest()[:16]
            obj = os.path.join(obj_dir, f"{os.path.basename(src)}.{h}.o")
            objects.append(obj)
            if not os.path.exists(obj):
                jobs.append(([nvcc, "-c", src, "-o", obj + ".tmp", *flags, *includes], obj))
        log(f"CUDA kernels for {arch_str} ({why_archs}): compiling {len(jobs)} of {len(sources)} sources"
            + (" (minutes: nvcc is slow on few cores; QKERNELS_CUDA=0 skips it)" if jobs else
               ", reusing build/cuda-objects"))

        def compile_one(cmd, obj):  # renamed once whole, so an interrupted build leaves no object to reuse
            subprocess.check_call(cmd)
            os.replace(obj + ".tmp", obj)

        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for fut in [pool.submit(compile_one, *job) for job in jobs]:
                fut.result()
        os.makedirs(out_dir, exist_ok=True)
        link = [nvcc, "-shared", "-o", target, *objects, *gencode]
        try:
            subprocess.check_call(link + ["-cudart", "static"])
            how = "cudart linked statically"
        except subprocess.CalledProcessError:
            # pip's NVIDIA wheels ship libcudart.so only: link it dynamically and record where it is.
            dirs = cudart_dirs(nvcc)
            extra = []
            for d in dirs:
                extra += [f"-L{d}", "-Xlinker", f"-rpath={d}"]
            subprocess.check_call(link + ["-cudart", "shared", *extra])
            how = f"cudart linked dynamically (rpath {', '.join(dirs) or 'none'})"
        log(f"built {target} for {arch_str}; {how}")


sources = sorted(glob.glob("csrc/*.c") + glob.glob("csrc/cpu/*.c") + glob.glob("csrc/ops/*.c"))
extra_link = ["-pthread"]
extra_compile = []
if os.environ.get("QKERNELS_ASAN") == "1":
    extra_compile += ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"]
    extra_link += ["-fsanitize=address"]

include_dirs = ["include"]
define_macros = []
# The XLA FFI handlers of qkernels.jax: plain C against the ABI csrc/ffi/xla_ffi.h declares, so they
# build everywhere (no jaxlib at build time) and stay inert until qkernels.jax registers them.
sources += sorted(glob.glob("csrc/ffi/*.c"))

setup(
    ext_modules=[
        Extension(
            "qkernels._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            depends=glob.glob("csrc/**/*.h", recursive=True) + glob.glob("include/qkernels/*.h"),
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
