/* The part of XLA's FFI C ABI that the handlers use, declared here so that they build on any
 * machine, jax or not: pip's isolated build cannot see an installed jaxlib, whose include/ holds
 * the official header (xla/ffi/api/c_api.h).
 *
 * The ABI is stable by XLA's rules: structs only grow at their end and every struct says its size,
 * so a runtime newer than the version claimed here (XLA_FFI_API_MAJOR.MINOR) serves these fields at
 * these offsets.  The names are the C API's own, so handlers.c reads as its documentation does;
 * tests/test_jax_abi.py compiles a check of every size, offset and constant below against the
 * official header of the installed jaxlib. */
#ifndef QK_XLA_FFI_H
#define QK_XLA_FFI_H

#include <stddef.h>
#include <stdint.h>

/* The API version the handlers were written against; the runtime must be at least this. */
#define XLA_FFI_API_MAJOR 0
#define XLA_FFI_API_MINOR 3

/* The size a struct has up to and including `last`: what its struct_size field carries. */
#define QK_FFI_SIZE_THROUGH(type, last) (offsetof(type, last) + sizeof(((type *)0)->last))

typedef struct XLA_FFI_Api XLA_FFI_Api;
typedef struct XLA_FFI_Error XLA_FFI_Error; /* opaque: made and destroyed by the runtime */
typedef struct XLA_FFI_ExecutionContext XLA_FFI_ExecutionContext; /* opaque */
typedef struct XLA_FFI_Future XLA_FFI_Future;                     /* opaque, unused */

typedef enum { XLA_FFI_Extension_Metadata = 1 } XLA_FFI_Extension_Type;

/* Every extension of a call frame starts with this; `next` chains them. */
typedef struct XLA_FFI_Extension_Base {
    size_t struct_size;
    XLA_FFI_Extension_Type type;
    struct XLA_FFI_Extension_Base *next;
} XLA_FFI_Extension_Base;

typedef struct XLA_FFI_Api_Version {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int major_version;
    int minor_version;
} XLA_FFI_Api_Version;
enum { XLA_FFI_Api_Version_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Api_Version, minor_version) };

/* absl status codes: the ones the handlers return. */
typedef enum {
    XLA_FFI_Error_Code_OK = 0,
    XLA_FFI_Error_Code_INVALID_ARGUMENT = 3,
    XLA_FFI_Error_Code_RESOURCE_EXHAUSTED = 8,
    XLA_FFI_Error_Code_FAILED_PRECONDITION = 9,
    XLA_FFI_Error_Code_UNIMPLEMENTED = 12,
    XLA_FFI_Error_Code_INTERNAL = 13,
} XLA_FFI_Error_Code;

/* XLA's primitive types (its PrimitiveType numbers): the ones the ops take. */
typedef enum {
    XLA_FFI_DataType_INVALID = 0,
    XLA_FFI_DataType_PRED = 1,
    XLA_FFI_DataType_S8 = 2,
    XLA_FFI_DataType_S32 = 4,
    XLA_FFI_DataType_S64 = 5,
    XLA_FFI_DataType_U8 = 6,
    XLA_FFI_DataType_U32 = 8,
    XLA_FFI_DataType_U64 = 9,
    XLA_FFI_DataType_F16 = 10,
    XLA_FFI_DataType_F32 = 11,
    XLA_FFI_DataType_F64 = 12,
    XLA_FFI_DataType_BF16 = 16,
} XLA_FFI_DataType;

typedef enum { XLA_FFI_ArgType_BUFFER = 1 } XLA_FFI_ArgType;
typedef enum { XLA_FFI_RetType_BUFFER = 1 } XLA_FFI_RetType;
typedef enum { XLA_FFI_AttrType_SCALAR = 3 } XLA_FFI_AttrType; /* also ARRAY 1, DICTIONARY 2, STRING 4 */
typedef enum { XLA_FFI_ExecutionStage_EXECUTE = 3 } XLA_FFI_ExecutionStage; /* after INSTANTIATE, PREPARE, INITIALIZE */

/* A dense row-major array on the call's device. */
typedef struct XLA_FFI_Buffer {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_DataType dtype;
    void *data;
    int64_t rank;
    int64_t *dims;
} XLA_FFI_Buffer;

typedef struct XLA_FFI_ByteSpan {
    const char *ptr;
    size_t len;
} XLA_FFI_ByteSpan;

typedef struct XLA_FFI_Scalar {
    XLA_FFI_DataType dtype;
    void *value;
} XLA_FFI_Scalar;

typedef struct XLA_FFI_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int64_t size;
    XLA_FFI_ArgType *types;
    void **args; /* XLA_FFI_Buffer * each */
} XLA_FFI_Args;

typedef struct XLA_FFI_Rets {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int64_t size;
    XLA_FFI_RetType *types;
    void **rets; /* XLA_FFI_Buffer * each */
} XLA_FFI_Rets;

/* Attributes in name order; a scalar's attrs[i] is an XLA_FFI_Scalar *. */
typedef struct XLA_FFI_Attrs {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int64_t size;
    XLA_FFI_AttrType *types;
    XLA_FFI_ByteSpan **names;
    void **attrs;
} XLA_FFI_Attrs;

typedef struct XLA_FFI_CallFrame {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    const XLA_FFI_Api *api;
    XLA_FFI_ExecutionContext *ctx;
    XLA_FFI_ExecutionStage stage;
    XLA_FFI_Args args;
    XLA_FFI_Rets rets;
    XLA_FFI_Attrs attrs;
    XLA_FFI_Future *future; /* set only by asynchronous handlers */
} XLA_FFI_CallFrame;

typedef XLA_FFI_Error *XLA_FFI_Handler(XLA_FFI_CallFrame *call_frame);

enum { XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE = 1u << 0 };
typedef uint32_t XLA_FFI_Handler_Traits;

/* What a handler answers when the runtime asks for its metadata (a call frame whose extension
 * chain starts with an XLA_FFI_Extension_Metadata). */
typedef struct XLA_FFI_Metadata {
    size_t struct_size;
    XLA_FFI_Api_Version api_version;
    XLA_FFI_Handler_Traits traits;
    struct { int64_t type_id; } state_type_id; /* newer runtimes only: write it where struct_size covers it */
} XLA_FFI_Metadata;
enum { XLA_FFI_Metadata_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Metadata, traits) };

typedef struct XLA_FFI_Metadata_Extension {
    XLA_FFI_Extension_Base extension_base;
    XLA_FFI_Metadata *metadata;
} XLA_FFI_Metadata_Extension;
enum { XLA_FFI_Metadata_Extension_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Metadata_Extension, metadata) };

/* The runtime's services: each takes one args struct whose first field is its size. */
typedef struct XLA_FFI_Error_Create_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    const char *message; /* copied by the runtime */
    XLA_FFI_Error_Code errc;
} XLA_FFI_Error_Create_Args;
enum { XLA_FFI_Error_Create_Args_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Error_Create_Args, errc) };
typedef XLA_FFI_Error *XLA_FFI_Error_Create(XLA_FFI_Error_Create_Args *args);

typedef struct XLA_FFI_Error_Destroy_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_Error *error;
} XLA_FFI_Error_Destroy_Args;
enum { XLA_FFI_Error_Destroy_Args_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Error_Destroy_Args, error) };
typedef void XLA_FFI_Error_Destroy(XLA_FFI_Error_Destroy_Args *args);

typedef struct XLA_FFI_Stream_Get_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_ExecutionContext *ctx;
    void *stream; /* out: the platform's stream (a cudaStream_t on CUDA) */
} XLA_FFI_Stream_Get_Args;
enum { XLA_FFI_Stream_Get_Args_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_Stream_Get_Args, stream) };
typedef XLA_FFI_Error *XLA_FFI_Stream_Get(XLA_FFI_Stream_Get_Args *args);

typedef struct XLA_FFI_DeviceMemory_Allocate_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_ExecutionContext *ctx;
    size_t size;
    size_t alignment;
    void *data; /* out */
} XLA_FFI_DeviceMemory_Allocate_Args;
enum { XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_DeviceMemory_Allocate_Args, data) };
typedef XLA_FFI_Error *XLA_FFI_DeviceMemory_Allocate(XLA_FFI_DeviceMemory_Allocate_Args *args);

typedef struct XLA_FFI_DeviceMemory_Free_Args {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_ExecutionContext *ctx;
    size_t size;
    void *data;
} XLA_FFI_DeviceMemory_Free_Args;
enum { XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE = QK_FFI_SIZE_THROUGH(XLA_FFI_DeviceMemory_Free_Args, data) };
typedef XLA_FFI_Error *XLA_FFI_DeviceMemory_Free(XLA_FFI_DeviceMemory_Free_Args *args);

/* The runtime's table: the services in their ABI order, the ones the handlers do not call as
 * untyped slots.  The table goes on past the last slot declared here. */
struct XLA_FFI_Api {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_Api_Version api_version;
    const void *internal_api;
    XLA_FFI_Error_Create *XLA_FFI_Error_Create;
    void *XLA_FFI_Error_GetMessage;
    XLA_FFI_Error_Destroy *XLA_FFI_Error_Destroy;
    void *XLA_FFI_Handler_Register;
    XLA_FFI_Stream_Get *XLA_FFI_Stream_Get;
    void *XLA_FFI_Type_Register;
    void *XLA_FFI_ExecutionContext_Get;
    void *XLA_FFI_State_Set;
    void *XLA_FFI_State_Get;
    XLA_FFI_DeviceMemory_Allocate *XLA_FFI_DeviceMemory_Allocate;
    XLA_FFI_DeviceMemory_Free *XLA_FFI_DeviceMemory_Free;
};
/* The runtime's table must reach this far for the services above. */
enum { QK_FFI_API_MIN_SIZE = QK_FFI_SIZE_THROUGH(struct XLA_FFI_Api, XLA_FFI_DeviceMemory_Free) };

#endif
