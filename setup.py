"""Build qkernels: the pure-C extension qkernels._C and, when nvcc is found, the CUDA kernels as
a separate shared object (qkernels/_qkernels_cuda.so) that _C opens at first CUDA use.

Environment:
  QKERNELS_CUDA=0         build the CPU-only extension even when nvcc is present
  QKERNELS_CUDA_ARCH      compute capabilities to compile, e.g. "90" or "80;89;90" (default);
                          PTX for the highest is embedded too
  CUDA_HOME / CUDA_PATH   the toolkit to use (else nvcc on PATH)
  QKERNELS_ASAN=1         build _C with AddressSanitizer (debug)
"""

import concurrent.futures
import glob
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
        archs = [a.strip() for a in os.environ.get("QKERNELS_CUDA_ARCH", "80;89;90").replace(",", ";").split(";") if a.strip()]
        gencode, defines = [], []
        for a in archs:
            # sm_90 machine code is built as sm_90a: the Hopper-only instructions (wgmma) of
            # attention_prefill_sm90.cu need it, and it runs on every compute capability 9.0 GPU.
            v = a + "a" if a == "90" else a
            gencode += ["-gencode", f"arch=compute_{v},code=sm_{v}"]
            if a == "90":
                defines.append("-DQK_SM90A=1")
        top = max(archs, key=int)
        gencode += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
        arch_str = " ".join(f"sm_{a}a" if a == "90" else f"sm_{a}" for a in archs) + f" +PTX(compute_{top})"
        # Objects are kept per architecture set and reused while newer than their source and the
        # shared headers; the sources compile in parallel (nvcc is single-threaded).
        obj_dir = os.path.join(self.build_temp, "cuda-" + "-".join(a + "a" if a == "90" else a for a in archs))
        os.makedirs(obj_dir, exist_ok=True)
        includes = [f"-I{d}" for d in cuda_include_dirs()]
        sources = sorted(glob.glob(os.path.join(HERE, "kernels", "*.cu")))
        headers = glob.glob(os.path.join(HERE, "kernels", "*.h")) + glob.glob(os.path.join(HERE, "kernels", "*.cuh"))
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)
        objects, jobs = [], []
        for src in sources:
            obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
            objects.append(obj)
            if os.path.exists(obj) and os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header):
                continue
            jobs.append([nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                         f'-DQK_ARCHS="{arch_str}"', *defines, "-lineinfo", *includes, *gencode])
        log(f"compiling {len(jobs)} of {len(sources)} CUDA sources with {nvcc} for {arch_str}")
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for fut in [pool.submit(subprocess.check_call, cmd) for cmd in jobs]:
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

setup(
    ext_modules=[
        Extension(
            "qkernels._C",
            sources=sources,
            depends=glob.glob("csrc/**/*.h", recursive=True) + ["kernels/qk_launch.h"],
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
