#include <stddef.h>

#include "cpu_kernels.h"

/* The layout of every struct Python passes in, as this compiler laid it out: kernels/native.py
 * compares its ctypes mirrors with it when it loads the library and refuses a library that
 * disagrees (a wrong offset would have the kernels read a pointer out of an int). Each struct
 * lists every one of its fields, in declaration order. */

typedef struct {
    const char *name;
    int64_t offset, size;
} field_layout;

#define FIELD(T, F) {#F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T *)0)->F)}

static const field_layout MATRIX_FIELDS[] = {
    FIELD(pd_matrix, kind), FIELD(pd_matrix, int8_x), FIELD(pd_matrix, n), FIELD(pd_matrix, k),
    FIELD(pd_matrix, qs),   FIELD(pd_matrix, d),      FIELD(pd_matrix, c), FIELD(pd_matrix, bias),
};
static const field_layout LAYER_FIELDS[] = {
    FIELD(pd_layer, in_norm), FIELD(pd_layer, post_norm), FIELD(pd_layer, qkv),
    FIELD(pd_layer, o),       FIELD(pd_layer, gate_up),   FIELD(pd_layer, down),
    FIELD(pd_layer, window),  FIELD(pd_layer, q_norm),    FIELD(pd_layer, k_norm),
    FIELD(pd_layer, attn_out_norm), FIELD(pd_layer, mlp_out_norm), FIELD(pd_layer, act),
    FIELD(pd_layer, local_rope), FIELD(pd_layer, softcap), FIELD(pd_layer, act_alpha),
    FIELD(pd_layer, act_limit), FIELD(pd_layer, sinks), FIELD(pd_layer, moe),
};
static const field_layout MOE_FIELDS[] = {
    FIELD(pd_moe, router),       FIELD(pd_moe, num_experts),    FIELD(pd_moe, top_k),
    FIELD(pd_moe, norm_topk),    FIELD(pd_moe, reserved),       FIELD(pd_moe, width),
    FIELD(pd_moe, gate_up),      FIELD(pd_moe, down),           FIELD(pd_moe, shared_width),
    FIELD(pd_moe, shared_gate_up), FIELD(pd_moe, shared_down),  FIELD(pd_moe, shared_gate),
    FIELD(pd_moe, router_bias),
};

#define COUNT(A) ((int)(sizeof(A) / sizeof((A)[0])))

static const struct {
    const char *name;
    int64_t size;
    const field_layout *fields;
    int num_fields;
} STRUCTS[] = {
    {"pd_matrix", sizeof(pd_matrix), MATRIX_FIELDS, COUNT(MATRIX_FIELDS)},
    {"pd_layer", sizeof(pd_layer), LAYER_FIELDS, COUNT(LAYER_FIELDS)},
    {"pd_moe", sizeof(pd_moe), MOE_FIELDS, COUNT(MOE_FIELDS)},
};

/* Struct s's field i: its name, offset and size; field -1 is the struct itself (its name,
 * offset 0, its sizeof). Returns 0, or -1 when s or i is past the last one. */
int pd_struct_layout(int s, int i, const char **name, int64_t *offset, int64_t *size) {
    if (s < 0 || s >= COUNT(STRUCTS) || i < -1 || i >= STRUCTS[s].num_fields) return -1;
    if (i == -1) {
        *name = STRUCTS[s].name;
        *offset = 0;
        *size = STRUCTS[s].size;
    } else {
        *name = STRUCTS[s].fields[i].name;
        *offset = STRUCTS[s].fields[i].offset;
        *size = STRUCTS[s].fields[i].size;
    }
    return 0;
}
