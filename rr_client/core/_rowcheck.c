/* Fast exact validation of routing rows: one pass over (rows, L, K) expert ids.
 * Finds the first id >= num_experts, the first MoE (row, layer) whose K ids are not distinct,
 * and the first dense-layer entry that is non-zero. The numpy fallback in _rowcheck.py has the
 * same semantics; tests compare the two. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* status codes shared with _rowcheck.py */
enum { OK = 0, OUT_OF_RANGE = 1, NOT_DISTINCT = 2, DENSE_NONZERO = 3 };

static inline int has_zero_byte(uint64_t v) {
    return ((v - 0x0101010101010101ULL) & ~v & 0x8080808080808080ULL) != 0;
}
static inline uint64_t rotr64(uint64_t v, int s) { return (v >> s) | (v << (64 - s)); }

/* K == 8, uint8: all 28 pairs with 4 rotations of the packed word. */
static inline int distinct8_u8(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return !(has_zero_byte(w ^ rotr64(w, 8)) | has_zero_byte(w ^ rotr64(w, 16)) |
             has_zero_byte(w ^ rotr64(w, 24)) | has_zero_byte(w ^ rotr64(w, 32)));
}

#define DEFINE_CHECK(NAME, T)                                                              \
    static int NAME(const T *d, Py_ssize_t rows, Py_ssize_t L, Py_ssize_t K, long E,      \
                    const uint8_t *moe, Py_ssize_t *bad_row, Py_ssize_t *bad_layer) {     \
        Py_ssize_t n = rows * L * K;                                                       \
        T mx = 0;                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) mx = d[i] > mx ? d[i] : mx;                     \
        if ((long)mx >= E) {                                                               \
            for (Py_ssize_t i = 0; i < n; i++)                                             \
                if ((long)d[i] >= E) {                                                     \
                    *bad_row = i / (L * K); *bad_layer = (i / K) % L; return OUT_OF_RANGE; \
                }                                                                          \
        }                                                                                  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                            \
            for (Py_ssize_t l = 0; l < L; l++) {                                           \
                const T *p = d + (r * L + l) * K;                                          \
                if (!moe[l]) {                                                             \
                    for (Py_ssize_t a = 0; a < K; a++)                                     \
                        if (p[a]) { *bad_row = r; *bad_layer = l; return DENSE_NONZERO; }  \
                    continue;                                                              \
                }                                                                          \
                int dup = 0;                                                               \
                if (sizeof(T) == 1 && K == 8) dup = !distinct8_u8((const uint8_t *)p);     \
                else                                                                       \
                    for (Py_ssize_t a = 1; a < K; a++)                                     \
                        for (Py_ssize_t b = 0; b < a; b++) dup |= (p[a] == p[b]);          \
                if (dup) { *bad_row = r; *bad_layer = l; return NOT_DISTINCT; }            \
            }                                                                              \
        }                                                                                  \
        return OK;                                                                         \
    }

DEFINE_CHECK(check_u8_generic, uint8_t)

/* Fast path for the common uint8 top-8 case: branch-free over packed 8-byte rows, in blocks;
 * a flagged block is rescanned by the generic checker to locate the first bad row. */
__attribute__((target_clones("avx2","default"))) static int check_u8(const uint8_t *d, Py_ssize_t rows, Py_ssize_t L, Py_ssize_t K, long E,
                    const uint8_t *moe, Py_ssize_t *bad_row, Py_ssize_t *bad_layer) {
    if (K != 8 || L > 4096) return check_u8_generic(d, rows, L, K, E, moe, bad_row, bad_layer);
    uint64_t sel[4096];
    for (Py_ssize_t l = 0; l < L; l++) sel[l] = moe[l] ? ~0ULL : 0ULL;
    const Py_ssize_t block = 64;
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += block) {
        Py_ssize_t r1 = r0 + block < rows ? r0 + block : rows;
        uint64_t bad = 0;
        uint8_t mx = 0;
        for (Py_ssize_t r = r0; r < r1; r++) {
            const uint8_t *row = d + r * L * 8;
            for (Py_ssize_t l = 0; l < L; l++) {
                uint64_t w;
                memcpy(&w, row + l * 8, 8);
                uint64_t dup = (uint64_t)(has_zero_byte(w ^ rotr64(w, 8)) | has_zero_byte(w ^ rotr64(w, 16)) |
                                          has_zero_byte(w ^ rotr64(w, 24)) | has_zero_byte(w ^ rotr64(w, 32)));
                uint64_t nz = (uint64_t)(w != 0);
                bad |= (dup & sel[l]) | (nz & ~sel[l]);
            }
            for (Py_ssize_t i = 0; i < L * 8; i++) mx = row[i] > mx ? row[i] : mx;
        }
        if (bad || (long)mx >= E) {
            int st = check_u8_generic(d + r0 * L * 8, r1 - r0, L, K, E, moe, bad_row, bad_layer);
            if (st != OK) {
                *bad_row += r0;
                if (st == OUT_OF_RANGE) return st;
                /* an earlier block may still hold an out-of-range id: the generic checker reports
                 * range errors first over the whole buffer, so keep that order */
                Py_ssize_t rr, ll;
                if (check_u8_generic(d, r0, L, K, E, moe, &rr, &ll) == OUT_OF_RANGE) { *bad_row = rr; *bad_layer = ll; return OUT_OF_RANGE; }
                for (Py_ssize_t r = r1; r < rows; r++)
                    for (Py_ssize_t i = 0; i < L * 8; i++)
                        if ((long)d[r * L * 8 + i] >= E) { *bad_row = r; *bad_layer = i / 8; return OUT_OF_RANGE; }
                return st;
            }
        }
    }
    return OK;
}
DEFINE_CHECK(check_u16, uint16_t)

/* check_rows(buffer, rows, L, K, itemsize, num_experts, moe_mask: bytes(L)) -> (status, row, layer) */
static PyObject *check_rows(PyObject *self, PyObject *args) {
    Py_buffer buf, mask;
    Py_ssize_t rows, L, K, itemsize;
    long E;
    if (!PyArg_ParseTuple(args, "y*nnnnly*", &buf, &rows, &L, &K, &itemsize, &E, &mask)) return NULL;
    PyObject *res = NULL;
    if (rows < 0 || L <= 0 || K <= 0 || (itemsize != 1 && itemsize != 2) || mask.len != L ||
        buf.len != rows * L * K * itemsize) {
        PyErr_SetString(PyExc_ValueError, "check_rows: inconsistent sizes");
        goto done;
    }
    Py_ssize_t br = -1, bl = -1;
    int st;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 1) st = check_u8((const uint8_t *)buf.buf, rows, L, K, E, (const uint8_t *)mask.buf, &br, &bl);
    else st = check_u16((const uint16_t *)buf.buf, rows, L, K, E, (const uint8_t *)mask.buf, &br, &bl);
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("inn", st, br, bl);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&mask);
    return res;
}

static PyMethodDef methods[] = {
    {"check_rows", check_rows, METH_VARARGS, "Validate routing rows; returns (status, row, layer)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcheck_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcheck_c(void) { return PyModule_Create(&module); }
