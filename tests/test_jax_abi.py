"""csrc/ffi/xla_ffi.h against the installed jaxlib's own XLA FFI header: the same program, compiled
once against each, prints every size, field offset and constant the handlers rely on, and the two
outputs must agree (a layout change in a new jaxlib fails here, not in a call)."""

import os
import shutil
import subprocess
import sysconfig

import pytest

jax_ffi = pytest.importorskip("jax.ffi")

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = os.path.join(os.path.dirname(HERE), "csrc", "ffi")

FIELDS = {  # struct: the fields the handlers read or write
    "XLA_FFI_Extension_Base": ["struct_size", "type", "next"],
    "XLA_FFI_Api_Version": ["struct_size", "extension_start", "major_version", "minor_version"],
    "XLA_FFI_Buffer": ["struct_size", "extension_start", "dtype", "data", "rank", "dims"],
    "XLA_FFI_ByteSpan": ["ptr", "len"],
    "XLA_FFI_Scalar": ["dtype", "value"],
    "XLA_FFI_Args": ["struct_size", "extension_start", "size", "types", "args"],
    "XLA_FFI_Rets": ["struct_size", "extension_start", "size", "types", "rets"],
    "XLA_FFI_Attrs": ["struct_size", "extension_start", "size", "types", "names", "attrs"],
    "XLA_FFI_CallFrame": ["struct_size", "extension_start", "api", "ctx", "stage", "args", "rets", "attrs", "future"],
    "XLA_FFI_Metadata": ["struct_size", "api_version", "traits", "state_type_id"],
    "XLA_FFI_Metadata_Extension": ["extension_base", "metadata"],
    "XLA_FFI_Error_Create_Args": ["struct_size", "extension_start", "message", "errc"],
    "XLA_FFI_Error_Destroy_Args": ["struct_size", "extension_start", "error"],
    "XLA_FFI_Stream_Get_Args": ["struct_size", "extension_start", "ctx", "stream"],
    "XLA_FFI_DeviceMemory_Allocate_Args": ["struct_size", "extension_start", "ctx", "size", "alignment", "data"],
    "XLA_FFI_DeviceMemory_Free_Args": ["struct_size", "extension_start", "ctx", "size", "data"],
    "XLA_FFI_Api": ["struct_size", "extension_start", "api_version", "internal_api", "XLA_FFI_Error_Create",
                    "XLA_FFI_Error_Destroy", "XLA_FFI_Stream_Get", "XLA_FFI_DeviceMemory_Allocate",
                    "XLA_FFI_DeviceMemory_Free"],
}
WHOLE = [s for s in FIELDS if s != "XLA_FFI_Api"]  # declared whole here: their sizes must match too
CONSTANTS = [
    "XLA_FFI_API_MAJOR", "XLA_FFI_Extension_Metadata", "XLA_FFI_Error_Code_OK", "XLA_FFI_Error_Code_INVALID_ARGUMENT",
    "XLA_FFI_Error_Code_RESOURCE_EXHAUSTED", "XLA_FFI_Error_Code_FAILED_PRECONDITION",
    "XLA_FFI_Error_Code_UNIMPLEMENTED", "XLA_FFI_Error_Code_INTERNAL", "XLA_FFI_ArgType_BUFFER",
    "XLA_FFI_RetType_BUFFER", "XLA_FFI_AttrType_SCALAR", "XLA_FFI_ExecutionStage_EXECUTE",
    "XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE", "XLA_FFI_Api_Version_STRUCT_SIZE",
    "XLA_FFI_Metadata_STRUCT_SIZE", "XLA_FFI_Metadata_Extension_STRUCT_SIZE", "XLA_FFI_Error_Create_Args_STRUCT_SIZE",
    "XLA_FFI_Error_Destroy_Args_STRUCT_SIZE", "XLA_FFI_Stream_Get_Args_STRUCT_SIZE",
    "XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE", "XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE",
] + [f"XLA_FFI_DataType_{t}" for t in ("INVALID", "PRED", "S8", "S32", "S64", "U8", "U32", "U64", "F16", "F32",
                                        "F64", "BF16")]


def _program():
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#ifdef OURS", '#include "xla_ffi.h"', "#else",
             '#include "xla/ffi/api/c_api.h"', "#endif", "int main(void) {"]
    for s, fields in FIELDS.items():
        t = s if s != "XLA_FFI_Api" else "struct XLA_FFI_Api"
        for f in fields:
            lines.append(f'    printf("{s}.{f}=%zu %zu\\n", offsetof({t}, {f}), sizeof((({t} *)0)->{f}));')
    lines += [f'    printf("sizeof {s}=%zu\\n", sizeof({s}));' for s in WHOLE]
    lines += [f'    printf("{c}=%lld\\n", (long long)({c}));' for c in CONSTANTS]
    lines += ['    printf("minor=%d\\n", XLA_FFI_API_MINOR);', "    return 0;", "}"]
    return "\n".join(lines) + "\n"


def _run(tmp_path, cc, name, flags):
    exe = tmp_path / name
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", *flags, "-o", str(exe), str(tmp_path / "abi.c")], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    return dict(line.split("=", 1) for line in out)


def test_declared_abi_matches_the_installed_jaxlib(tmp_path):
    official = jax_ffi.include_dir()
    if not os.path.isfile(os.path.join(official, "xla", "ffi", "api", "c_api.h")):
        pytest.skip("this jaxlib ships no XLA FFI C header")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    (tmp_path / "abi.c").write_text(_program())
    ours = _run(tmp_path, cc, "ours", ["-DOURS", f"-I{OURS}"])
    theirs = _run(tmp_path, cc, "theirs", [f"-I{official}"])
    assert int(ours.pop("minor")) <= int(theirs.pop("minor")), "the handlers claim a newer API than this jaxlib's"
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}
