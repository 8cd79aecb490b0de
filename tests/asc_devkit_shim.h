// AuraKernel's stand-ins for what the bisheng (CCE) compiler builds in, so that g++ -fsyntax-only can
// parse a kernel against the real AscendC headers of an asc-devkit checkout (tests/test_ascendc.py,
// ASC_DEVKIT_PATH): its function qualifiers and address spaces (empty here), its element and
// enumeration types, and its intrinsics, declared by name only (any arguments, an integer result).
// Nothing here is taken from the devkit; the names are those the headers call.
#pragma once
#include <cstdint>
#include <cstddef>
#define __aicore__
#define __global__
#define __gm__
#define __ubuf__
#define __cbuf__
#define __ca__
#define __cb__
#define __cc__
#define __fbuf__
#define __sync_alias__
#define __check_sync_alias__
#define __simd_callee__
#define __ssbuf__
#define __biasbuf__
#define __in_pipe__(...)
#define __out_pipe__(...)
#define __inout_pipe__(...)
using half = _Float16;
struct bfloat16_t { uint16_t v; bfloat16_t() = default; bfloat16_t(float) {} operator float() const { return 0; } };
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_MTE4, PIPE_MTE5, PIPE_V2, PIPE_FIX };
enum event_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
enum mem_dsb_t { DSB_ALL, DSB_DDR, DSB_UB, DSB_SEQ };
enum dcci_dst_t { CACHELINE_ALL, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };
enum cache_line_t { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
enum QuantMode_t { NoQuant, F322F16, F322BF16, DEQF16, VDEQF16, QF322B8_PRE, VQF322B8_PRE, REQ8, VREQ8, DEQS322F16 };
enum Order_t { VALUE_INDEX, INDEX_VALUE, ONLY_VALUE, ONLY_INDEX };
enum pad_t { PAD_NONE };
enum atomic_type_t { ATOMIC_NONE };
enum atomic_op_t { ATOMIC_SUM };
enum mem_t { L1, L0A, L0B, L0C, UB, BT };
enum ub_addr8_t { VA0, VA1, VA2, VA3, VA4, VA5, VA6, VA7 };
enum vld_len_t { L128, H128 };
enum addr_cal_mode_t { inc, dec };
struct vector_bool {}; struct vector_align {}; struct vector_address {};   // the register API of newer headers
namespace bisheng { namespace cce { template <class... A> inline void metrics_prof_start(A...) {} template <class... A> inline void metrics_prof_stop(A...) {} template <auto P, class... A> inline void mark_stamp(A...) {} } }
#define AK_BUILTIN(name) template <class... A> inline int64_t name(A&&...) { return 0; }
AK_BUILTIN(__get_entry_sys_cnt) AK_BUILTIN(__ib_set_stub) AK_BUILTIN(__ib_wait_stub)
AK_BUILTIN(__sync_all_stub) AK_BUILTIN(asc_prof_start) AK_BUILTIN(asc_prof_stop) AK_BUILTIN(bcnt0)
AK_BUILTIN(bcnt1) AK_BUILTIN(clz) AK_BUILTIN(conv_f322f16o) AK_BUILTIN(conv_f322s32a)
AK_BUILTIN(conv_f322s32c) AK_BUILTIN(conv_f322s32f) AK_BUILTIN(conv_f322s32r)
AK_BUILTIN(copy_cbuf_to_bt) AK_BUILTIN(copy_cbuf_to_fbuf) AK_BUILTIN(copy_cbuf_to_gm)
AK_BUILTIN(copy_gm_to_cbuf) AK_BUILTIN(copy_gm_to_cbuf_multi_nd2nz_b16)
AK_BUILTIN(copy_gm_to_cbuf_multi_nd2nz_b32s) AK_BUILTIN(copy_gm_to_cbuf_multi_nd2nz_b8)
AK_BUILTIN(copy_gm_to_ubuf) AK_BUILTIN(copy_gm_to_ubuf_align_b16)
AK_BUILTIN(copy_gm_to_ubuf_align_b32) AK_BUILTIN(copy_matrix_cc_to_gm) AK_BUILTIN(copy_ubuf_to_gm)
AK_BUILTIN(copy_ubuf_to_gm_align_b16) AK_BUILTIN(copy_ubuf_to_gm_align_b32)
AK_BUILTIN(copy_ubuf_to_gm_align_b8) AK_BUILTIN(copy_ubuf_to_ubuf) AK_BUILTIN(create_cbuf_matrix)
AK_BUILTIN(dc_preload) AK_BUILTIN(dcci) AK_BUILTIN(dsb) AK_BUILTIN(ffts_cross_core_sync)
AK_BUILTIN(get_acc_val) AK_BUILTIN(get_arch_ver) AK_BUILTIN(get_block_idx) AK_BUILTIN(get_block_num)
AK_BUILTIN(get_coreid) AK_BUILTIN(get_ctrl) AK_BUILTIN(get_icache_prl_st) AK_BUILTIN(get_imm)
AK_BUILTIN(get_max_min_cnt) AK_BUILTIN(get_pc) AK_BUILTIN(get_rsvd_cnt)
AK_BUILTIN(get_st_atomic_cfg) AK_BUILTIN(get_subblockdim) AK_BUILTIN(get_subblockid)
AK_BUILTIN(get_vms4_sr) AK_BUILTIN(hset_flag) AK_BUILTIN(hwait_flag)
AK_BUILTIN(img2colv2_cbuf_to_ca) AK_BUILTIN(img2colv2_cbuf_to_ca_s4)
AK_BUILTIN(img2colv2_cbuf_to_cb) AK_BUILTIN(ld_dev) AK_BUILTIN(load_cbuf_to_ca_s4)
AK_BUILTIN(load_cbuf_to_cb_s4) AK_BUILTIN(load_cbuf_to_cb_sp)
AK_BUILTIN(load_cbuf_to_cb_transpose_s4) AK_BUILTIN(mad_sp) AK_BUILTIN(pipe_barrier)
AK_BUILTIN(preload) AK_BUILTIN(sbitset0) AK_BUILTIN(sbitset1) AK_BUILTIN(scatter_vnchwconv_b16)
AK_BUILTIN(scatter_vnchwconv_b32) AK_BUILTIN(scatter_vnchwconv_b8) AK_BUILTIN(set_aipp_spr_0)
AK_BUILTIN(set_aipp_spr_1) AK_BUILTIN(set_aipp_spr_18) AK_BUILTIN(set_aipp_spr_19)
AK_BUILTIN(set_aipp_spr_2) AK_BUILTIN(set_aipp_spr_20) AK_BUILTIN(set_aipp_spr_21)
AK_BUILTIN(set_aipp_spr_3) AK_BUILTIN(set_aipp_spr_4) AK_BUILTIN(set_aipp_spr_5)
AK_BUILTIN(set_aipp_spr_6) AK_BUILTIN(set_aipp_spr_7) AK_BUILTIN(set_aipp_spr_8)
AK_BUILTIN(set_aipp_spr_9) AK_BUILTIN(set_atomic_add) AK_BUILTIN(set_atomic_bf16)
AK_BUILTIN(set_atomic_f16) AK_BUILTIN(set_atomic_f32) AK_BUILTIN(set_atomic_max)
AK_BUILTIN(set_atomic_min) AK_BUILTIN(set_atomic_none) AK_BUILTIN(set_atomic_s16)
AK_BUILTIN(set_atomic_s32) AK_BUILTIN(set_atomic_s8) AK_BUILTIN(set_cmpmask) AK_BUILTIN(set_ctrl)
AK_BUILTIN(set_data_exp_0) AK_BUILTIN(set_data_exp_1) AK_BUILTIN(set_data_exp_2)
AK_BUILTIN(set_data_exp_3) AK_BUILTIN(set_deqscale) AK_BUILTIN(set_ffts_base_addr)
AK_BUILTIN(set_flag) AK_BUILTIN(set_fmatrix) AK_BUILTIN(set_fmatrix_b) AK_BUILTIN(set_fpc)
AK_BUILTIN(set_l1_3d_size) AK_BUILTIN(set_l3d_rpt) AK_BUILTIN(set_mask_count)
AK_BUILTIN(set_mask_norm) AK_BUILTIN(set_mov_pad_val) AK_BUILTIN(set_nd_para)
AK_BUILTIN(set_padding) AK_BUILTIN(set_quant_pre) AK_BUILTIN(set_st_atomic_cfg)
AK_BUILTIN(set_va_reg_sb) AK_BUILTIN(set_vector_mask) AK_BUILTIN(sff0) AK_BUILTIN(sff1)
AK_BUILTIN(sflbits) AK_BUILTIN(st_dev) AK_BUILTIN(trap) AK_BUILTIN(vadd)
AK_BUILTIN(vand) AK_BUILTIN(vbrcb) AK_BUILTIN(vcmpv_eq) AK_BUILTIN(vcmpvs_eq)
AK_BUILTIN(vconv_bf162f32) AK_BUILTIN(vconv_bf162s32a) AK_BUILTIN(vconv_bf162s32c)
AK_BUILTIN(vconv_bf162s32f) AK_BUILTIN(vconv_bf162s32r) AK_BUILTIN(vconv_bf162s32z)
AK_BUILTIN(vconv_deq) AK_BUILTIN(vconv_f162f32) AK_BUILTIN(vconv_f162s16a)
AK_BUILTIN(vconv_f162s16c) AK_BUILTIN(vconv_f162s16f) AK_BUILTIN(vconv_f162s16r)
AK_BUILTIN(vconv_f162s16z) AK_BUILTIN(vconv_f162s32a) AK_BUILTIN(vconv_f162s32c)
AK_BUILTIN(vconv_f162s32f) AK_BUILTIN(vconv_f162s32r) AK_BUILTIN(vconv_f162s32z)
AK_BUILTIN(vconv_f162s4) AK_BUILTIN(vconv_f162s4a) AK_BUILTIN(vconv_f162s4c)
AK_BUILTIN(vconv_f162s4f) AK_BUILTIN(vconv_f162s4r) AK_BUILTIN(vconv_f162s4z)
AK_BUILTIN(vconv_f162s8) AK_BUILTIN(vconv_f162s8a) AK_BUILTIN(vconv_f162s8c)
AK_BUILTIN(vconv_f162s8f) AK_BUILTIN(vconv_f162s8r) AK_BUILTIN(vconv_f162s8z)
AK_BUILTIN(vconv_f162u8) AK_BUILTIN(vconv_f162u8a) AK_BUILTIN(vconv_f162u8c)
AK_BUILTIN(vconv_f162u8f) AK_BUILTIN(vconv_f162u8r) AK_BUILTIN(vconv_f162u8z)
AK_BUILTIN(vconv_f322bf16a) AK_BUILTIN(vconv_f322bf16c) AK_BUILTIN(vconv_f322bf16f)
AK_BUILTIN(vconv_f322bf16r) AK_BUILTIN(vconv_f322bf16z) AK_BUILTIN(vconv_f322f16)
AK_BUILTIN(vconv_f322f16a) AK_BUILTIN(vconv_f322f16c) AK_BUILTIN(vconv_f322f16f)
AK_BUILTIN(vconv_f322f16o) AK_BUILTIN(vconv_f322f16r) AK_BUILTIN(vconv_f322f16z)
AK_BUILTIN(vconv_f322f32a) AK_BUILTIN(vconv_f322f32c) AK_BUILTIN(vconv_f322f32f)
AK_BUILTIN(vconv_f322f32r) AK_BUILTIN(vconv_f322f32z) AK_BUILTIN(vconv_f322s16a)
AK_BUILTIN(vconv_f322s16c) AK_BUILTIN(vconv_f322s16f) AK_BUILTIN(vconv_f322s16r)
AK_BUILTIN(vconv_f322s16z) AK_BUILTIN(vconv_f322s32a) AK_BUILTIN(vconv_f322s32c)
AK_BUILTIN(vconv_f322s32f) AK_BUILTIN(vconv_f322s32r) AK_BUILTIN(vconv_f322s32z)
AK_BUILTIN(vconv_f322s64a) AK_BUILTIN(vconv_f322s64c) AK_BUILTIN(vconv_f322s64f)
AK_BUILTIN(vconv_f322s64r) AK_BUILTIN(vconv_f322s64z) AK_BUILTIN(vconv_s162f16)
AK_BUILTIN(vconv_s162f16a) AK_BUILTIN(vconv_s162f16c) AK_BUILTIN(vconv_s162f16f)
AK_BUILTIN(vconv_s162f16r) AK_BUILTIN(vconv_s162f16z) AK_BUILTIN(vconv_s162f32)
AK_BUILTIN(vconv_s322f32) AK_BUILTIN(vconv_s322f32a) AK_BUILTIN(vconv_s322f32c)
AK_BUILTIN(vconv_s322f32f) AK_BUILTIN(vconv_s322f32r) AK_BUILTIN(vconv_s322f32z)
AK_BUILTIN(vconv_s322s16) AK_BUILTIN(vconv_s322s64) AK_BUILTIN(vconv_s42f16)
AK_BUILTIN(vconv_s642f32a) AK_BUILTIN(vconv_s642f32c) AK_BUILTIN(vconv_s642f32f)
AK_BUILTIN(vconv_s642f32r) AK_BUILTIN(vconv_s642f32z) AK_BUILTIN(vconv_s642s32)
AK_BUILTIN(vconv_s82f16) AK_BUILTIN(vconv_u82f16) AK_BUILTIN(vcopy) AK_BUILTIN(vector_dup)
AK_BUILTIN(vgather) AK_BUILTIN(vld_va_reg) AK_BUILTIN(vmax) AK_BUILTIN(vmulconv_f162s8)
AK_BUILTIN(vmulconv_f162u8) AK_BUILTIN(vmuls) AK_BUILTIN(vor) AK_BUILTIN(vreducev2) AK_BUILTIN(vsel)
AK_BUILTIN(vtranspose) AK_BUILTIN(wait_flag) AK_BUILTIN(wait_flag_dev)
AK_BUILTIN(get_sys_cnt)
#undef AK_BUILTIN
