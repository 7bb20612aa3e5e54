/* The cpu backend's instruction-set paths for linear and swiglu (csrc/cpu/linear_x86.c): detected at
 * run time, so the build stays portable; qk_linear_args.cpu_isa caps the level for tests. */
#ifndef QK_LINEAR_ISA_H
#define QK_LINEAR_ISA_H

#include "qkernels/launch.h"

/* The x86-64 kernels need GCC >= 11 or Clang >= 12 (AMX intrinsics and target attributes). */
#if defined(__x86_64__) && defined(__GNUC__) && \
    ((!defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define QK_X86_KERNELS 1
#endif

/* The best level this process may use (QK_CPU_ISA_PORTABLE when not x86-64 or built without the
 * kernels); AMX counts only once Linux has granted this process the tile state. */
int qk_cpu_isa_best(void);

/* The names of the levels, indexed by QK_CPU_ISA_* ("auto" for 0). */
extern const char *const qk_cpu_isa_names[QK_CPU_ISA_COUNT];

/* linear (swiglu = 0) or swiglu (1) on the best level up to a->cpu_isa, where that level has a
 * kernel for a->dtype: 1 with *status set, else 0 (the portable kernels take the call). */
int qk_linear_fast(const qk_linear_args *a, int swiglu, int *status);

#endif
