/* Loads the CUDA kernels' shared object at first use, so that a machine without a GPU, driver
 * or CUDA runtime imports qkernels fine and only reports AVAILABLE = False with the reason. */
#include "qk.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <stdio.h>

/* Process-wide: dlopen is per process, and deleters that free CUDA memory run without module state. */
static const qk_cuda_api *g_api;
static int g_tried;
static char g_reason[768] = "CUDA support not probed yet";

const qk_cuda_api *qk_cuda_loaded(void) { return g_api; }
const char *qk_cuda_unavailable_reason(void) { return g_api ? "" : g_reason; }

const qk_cuda_api *qk_cuda_try_load(qk_state *st) {
    if (g_tried) return g_api;
    g_tried = 1;
    if (st->cuda_path == Py_None) {
        snprintf(g_reason, sizeof g_reason, "qkernels was built without CUDA kernels (no nvcc, or QKERNELS_CUDA=0)");
        return NULL;
    }
    const char *path = PyUnicode_AsUTF8(st->cuda_path);
    if (path == NULL) {
        PyErr_Clear();
        snprintf(g_reason, sizeof g_reason, "the CUDA library path is not valid UTF-8");
        return NULL;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char *err = dlerror();
        snprintf(g_reason, sizeof g_reason, "could not load %s: %s", path, err ? err : "unknown error");
        return NULL;
    }
    qk_cuda_get_api_fn get = (qk_cuda_get_api_fn)dlsym(handle, "qk_cuda_get_api");
    const qk_cuda_api *api = get ? get(QK_CUDA_ABI) : NULL;
    if (api == NULL) {
        snprintf(g_reason, sizeof g_reason, "%s does not match this module (ABI %d); rebuild qkernels", path,
                 QK_CUDA_ABI);
        dlclose(handle);
        return NULL;
    }
    int count = 0, status = api->device_count(&count);
    if (status) {
        /* The runtime says "driver version is insufficient" also when there is no driver at all. */
        void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (driver == NULL) driver = dlopen("libcuda.so.1", RTLD_LAZY);
        if (driver == NULL)
            snprintf(g_reason, sizeof g_reason, "no NVIDIA driver found (libcuda.so.1 is not installed)");
        else
            snprintf(g_reason, sizeof g_reason, "no usable CUDA device: %s", api->error_string(status));
        if (driver) dlclose(driver);
        return NULL; /* keep the library mapped: unloading a CUDA runtime is not worth the risk */
    }
    if (count == 0) {
        snprintf(g_reason, sizeof g_reason, "no CUDA device found");
        return NULL;
    }
    /* cuBLASLt's location, from the environment read here: the kernels read none. */
    char roots[8192] = "";
    const char *home = getenv("CUDA_HOME"), *cuda_path = getenv("CUDA_PATH");
    snprintf(roots, sizeof roots, "%s:%s", home ? home : "", cuda_path ? cuda_path : "");
    api->set_cublaslt_search(getenv("QKERNELS_CUBLASLT"), roots);
    g_api = api;
    return g_api;
}

const qk_cuda_api *qk_cuda(qk_state *st, const char *op) {
    const qk_cuda_api *api = qk_cuda_try_load(st);
    if (api == NULL) PyErr_Format(PyExc_RuntimeError, "%s: CUDA kernels are not available: %s", op, g_reason);
    return api;
}

int qk_raise_status(const char *op, int status) {
    switch (status) {
    case QK_OK: return 0;
    case QK_E_UNSUPPORTED:
        PyErr_Format(PyExc_TypeError, "%s: no kernel was built for this combination of dtype and shape", op);
        break;
    case QK_E_NOMEM: PyErr_Format(PyExc_MemoryError, "%s: out of host memory", op); break;
    case QK_E_THREAD: PyErr_Format(PyExc_RuntimeError, "%s: could not start CPU worker threads", op); break;
    case QK_E_INDEX: PyErr_Format(PyExc_ValueError, "%s: an index is out of range", op); break;
    default:
        if (status > 0 && g_api)
            PyErr_Format(PyExc_RuntimeError, "%s: CUDA error %d: %s", op, status, g_api->error_string(status));
        else
            PyErr_Format(PyExc_RuntimeError, "%s: failed with status %d", op, status);
    }
    return -1;
}
