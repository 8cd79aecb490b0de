// AuraKernel's declaration of the CANN host API the rendered <op>_host.cpp uses (see ../README.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>
namespace ge {
enum graphStatus { GRAPH_SUCCESS, GRAPH_FAILED };
enum DataType { DT_FLOAT, DT_FLOAT16, DT_BF16, DT_INT8, DT_UINT8, DT_INT32, DT_INT64, DT_BOOL };
enum Format { FORMAT_ND };
}  // namespace ge
namespace gert {
struct Shape {
    size_t GetDimNum() const;
    int64_t GetDim(size_t index) const;
    int64_t GetShapeSize() const;
};
struct StorageShape { const Shape& GetStorageShape() const; };
struct RuntimeAttrs { template <typename T> const T* GetAttrPointer(size_t index) const; };
struct TilingData {
    size_t GetCapacity() const;
    void* GetData();
    void SetDataSize(size_t size);
};
struct TilingContext {
    void* GetPlatformInfo() const;
    const StorageShape* GetInputShape(size_t index) const;
    const StorageShape* GetOptionalInputShape(size_t index) const;
    const StorageShape* GetOutputShape(size_t index) const;
    const RuntimeAttrs* GetAttrs() const;
    void SetBlockDim(uint32_t blockDim);
    void SetScheduleMode(uint32_t mode);
    size_t* GetWorkspaceSizes(size_t count);
    TilingData* GetRawTilingData();
};
}  // namespace gert
namespace ops {
enum Option { REQUIRED, OPTIONAL };
struct OpParamDef {
    OpParamDef& ParamType(Option type);
    OpParamDef& DataType(std::vector<ge::DataType> types);
    OpParamDef& Format(std::vector<ge::Format> formats);
};
struct OpAttrDef {
    OpAttrDef& AttrType(Option type);
    OpAttrDef& Float();
    OpAttrDef& Float(float value);
    OpAttrDef& Int();
    OpAttrDef& Int(int64_t value);
    OpAttrDef& Bool(bool value);
};
struct OpAICoreDef {
    OpAICoreDef& SetTiling(ge::graphStatus (*func)(gert::TilingContext*));
    OpAICoreDef& AddConfig(const char* soc);
};
struct OpDef {
    explicit OpDef(const char* name);
    OpParamDef& Input(const char* name);
    OpParamDef& Output(const char* name);
    OpAttrDef& Attr(const char* name);
    OpAICoreDef& AICore();
};
}  // namespace ops
#define OP_ADD(opType) static ops::opType g_ak_op_##opType(#opType)
