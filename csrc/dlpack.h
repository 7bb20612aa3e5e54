/* The DLPack ABI (v1.3) as qkernels consumes and produces it.
 *
 * Written from the DLPack specification (https://dmlc.github.io/dlpack/latest/c_api.html):
 * only the declarations this project uses.  Layouts must match the specification exactly,
 * since they cross library boundaries. */
#ifndef QK_DLPACK_H
#define QK_DLPACK_H

#include <stdint.h>

#define QK_DLPACK_MAJOR 1
#define QK_DLPACK_MINOR 1

#define QK_DLPACK_FLAG_READ_ONLY (1ULL << 0)

/* PyCapsule names of the Python DLPack protocol. */
#define QK_CAPSULE_LEGACY "dltensor"
#define QK_CAPSULE_LEGACY_USED "used_dltensor"
#define QK_CAPSULE_VERSIONED "dltensor_versioned"
#define QK_CAPSULE_VERSIONED_USED "used_dltensor_versioned"
#define QK_CAPSULE_EXCHANGE_API "dlpack_exchange_api"

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLCUDAManaged = 13,
} DLDeviceType;

typedef struct {
    int32_t device_type; /* DLDeviceType; int32 in the ABI */
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLBool = 6,
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means C-contiguous */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The C exchange API a framework publishes as type(t).__dlpack_c_exchange_api__ (DLPack 1.3). */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind, const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor, void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#endif
