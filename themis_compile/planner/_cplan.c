/* Compiled core of the planner's per-layer hot path: Alg. 1 (materialize.py) and Alg. 3 (dispatch.py).
 *
 * Every function here reproduces its numpy counterpart bit for bit: the same selections, the same
 * tie-breaks and, for the modeled device loads of Alg. 1 l.10, the same floating-point operations in
 * the same order (build with -ffp-contract=off: a fused multiply-add would round differently). The
 * Python modules validate shapes and dtypes, allocate every output array and pass contiguous buffers:
 * int64 for ids and counts, float64 for loads, one byte per entry for boolean masks; the token counts
 * T[e, d] may be any strided 2-D int64 buffer.
 *
 * The topology arrives as one int64 buffer (`Topology.core_layout`):
 *     [N, D, uniform, k_N (N), node_offsets (N + 1), node_D (D)].
 *
 * Return codes of the Alg. 3 entry points: 0 done; 1 a negative token count; 2 an expert with tokens
 * and no holder; 3 the topology does not have the placement's D devices. On a nonzero code the outputs
 * are garbage and the caller re-runs its validation, which raises the precise ValueError.
 *
 * Only the CPython C API and the buffer protocol are used (no numpy headers), C99.
 *
 * Legend: E experts, D devices (d source, d2 destination), N nodes, J materializable experts,
 * S planned sources.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------ helpers */
typedef struct {
    int64_t N, D, uniform;
    const int64_t *k_N;     /* devices per node */
    const int64_t *off_N;   /* node n holds devices off_N[n] .. off_N[n + 1] - 1 */
    const int64_t *node_D;  /* node of every device */
} topo_t;

static int parse_topo(const Py_buffer *buf, topo_t *tp)
{
    const int64_t *p = (const int64_t *)buf->buf;
    Py_ssize_t words = buf->len / (Py_ssize_t)sizeof(int64_t);
    if (words < 3 || p[0] < 1 || p[1] < 1 || words != 3 + p[0] + p[0] + 1 + p[1]) {
        PyErr_SetString(PyExc_ValueError, "_cplan: malformed topology layout");
        return -1;
    }
    tp->N = p[0];
    tp->D = p[1];
    tp->uniform = p[2];
    tp->k_N = p + 3;
    tp->off_N = tp->k_N + tp->N;
    tp->node_D = tp->off_N + tp->N + 1;
    return 0;
}

static int check_len(const Py_buffer *buf, Py_ssize_t count, Py_ssize_t itemsize, const char *what)
{
    if (buf->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "_cplan: %s has %zd bytes, expected %zd", what, buf->len,
                     count * itemsize);
        return -1;
    }
    return 0;
}

/* numpy's float order (sorts and lexsorts): NaN after everything, NaNs equal. */
static inline int flt_lt(double a, double b)
{
    return a < b || (b != b && a == a);
}

/* ------------------------------------------------------------------------------------ Alg. 1 */
/* Sort key of _top_experts: load descending, ties lower id (a stable argsort of -load). */
typedef struct {
    double load;
    int64_t id;
} keyed_t;

static int cmp_top(const void *a, const void *b)
{
    const keyed_t *x = (const keyed_t *)a, *y = (const keyed_t *)b;
    if (x->load > y->load) return -1;
    if (x->load < y->load) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Alg. 1 l.3: the top-t experts by load, descending, ties by lower id, zero-load experts dropped.
 * Loads are finite and >= 0 (validated), so the positive ones lead the stable order. skip_E (may be
 * NULL): experts left out (calibration's fresh experts skip the replicated ones). -1: no memory. */
static Py_ssize_t top_experts(const double *load_E, Py_ssize_t E, Py_ssize_t t, const uint8_t *skip_E,
                              int64_t *top_J)
{
    keyed_t *keyed;
    Py_ssize_t J = 0;
    if (t <= 0) return 0;
    if (t <= 64) {   /* insertion into a sorted prefix: O(E) compares when t is small */
        for (Py_ssize_t e = 0; e < E; e++) {
            double x = load_E[e];
            if (!(x > 0) || (skip_E != NULL && skip_E[e])) continue;
            if (J == t && !(x > load_E[top_J[J - 1]])) continue;
            Py_ssize_t pos = J < t ? J : t - 1;
            while (pos > 0 && load_E[top_J[pos - 1]] < x) {   /* equal loads keep the lower id first */
                top_J[pos] = top_J[pos - 1];
                pos--;
            }
            top_J[pos] = e;
            if (J < t) J++;
        }
        return J;
    }
    keyed = (keyed_t *)malloc((size_t)(E > 0 ? E : 1) * sizeof(keyed_t));
    if (keyed == NULL) return -1;
    for (Py_ssize_t e = 0; e < E; e++)
        if (load_E[e] > 0 && (skip_E == NULL || !skip_E[e])) {
            keyed[J].load = load_E[e];
            keyed[J++].id = e;
        }
    qsort(keyed, (size_t)J, sizeof(keyed_t), cmp_top);
    if (J > t) J = t;
    for (Py_ssize_t j = 0; j < J; j++) top_J[j] = keyed[j].id;
    free(keyed);
    return J;
}

/* Alg. 1 l.9 for all experts at once (_assign_slots_by_load): highest averages, slot after slot to
 * the largest per-copy load load / (copies + n + 1), ties to the earlier expert of J, at most room_J
 * per expert; only positive quotients take a slot. A row's quotients do not increase, so this greedy
 * merge is the stable sort of numpy's quotient table.
 *
 * Bulk start: for a threshold lambda > 0, the quotients above lambda lead the sorted order, so when
 * there are at most total_slots of them the greedy takes all of them first: they are counted per row
 * (with the same division as the greedy, monotone in n) and only the remaining slots go one by one.
 * Thresholds tried, tightest first: sum(load) / (total_slots + sum(copies)) (a row then has about
 * load / lambda - copies quotients above it, which sum to about total_slots), halfway, and
 * sum(load) / total_slots (at most load / lambda quotients per row: up to rounding, at most
 * total_slots in all); the first whose count does not exceed total_slots is taken, else none. */
static int64_t count_above(double lambda, const double *load_J, const int64_t *copies_J, const int64_t *room_J,
                           Py_ssize_t J, int64_t limit, int64_t *n_J)
{
    int64_t counted = 0;
    for (Py_ssize_t j = 0; j < J; j++) {
        const double load = load_J[j];
        const int64_t c = copies_J[j], room = room_J[j];
        n_J[j] = 0;
        if (room <= 0 || !(load > 0)) continue;
        double guess = floor(load / lambda) - (double)c;     /* about the count; corrected below */
        int64_t n = guess <= 0 ? 0 : guess >= (double)room ? room : (int64_t)guess;
        while (n < room && load / (double)(c + n + 1) > lambda) n++;
        while (n > 0 && !(load / (double)(c + n) > lambda)) n--;
        n_J[j] = n;
        counted += n;
        if (counted > limit) return counted;
    }
    return counted;
}

static void assign_slots(const double *load_J, const int64_t *copies_J, const int64_t *room_J,
                         Py_ssize_t J, int64_t total_slots, int64_t *n_J, double *head_J)
{
    double sum = 0.0, held = 0.0;
    for (Py_ssize_t j = 0; j < J; j++) {
        n_J[j] = 0;
        sum += load_J[j];
        if (room_J[j] > 0 && load_J[j] > 0) held += (double)copies_J[j];
    }
    if (total_slots > 0) {
        const double T = (double)total_slots;
        const double lambdas[3] = {sum / (T + held), sum / (T + 0.5 * held), sum / T};
        for (int i = held > 0 ? 0 : 2; i < 3; i++) {
            const double lambda = lambdas[i];
            if (!(lambda > 0 && lambda < INFINITY)) continue;
            const int64_t counted = count_above(lambda, load_J, copies_J, room_J, J, total_slots, n_J);
            if (counted <= total_slots) {
                total_slots -= counted;
                break;
            }
            for (Py_ssize_t j = 0; j < J; j++) n_J[j] = 0;   /* too many above lambda: a looser one */
        }
    }
    for (Py_ssize_t j = 0; j < J; j++)   /* head_J: the quotient of a row's next slot, 0 when none */
        head_J[j] = n_J[j] < room_J[j] ? load_J[j] / (double)(copies_J[j] + n_J[j] + 1) : 0.0;
    for (int64_t s = 0; s < total_slots; s++) {
        Py_ssize_t best_j = -1;
        double best = 0.0;
        for (Py_ssize_t j = 0; j < J; j++)
            if (head_J[j] > best) {
                best = head_J[j];
                best_j = j;
            }
        if (best_j < 0) break;
        const int64_t n = ++n_J[best_j];
        head_J[best_j] = n < room_J[best_j] ? load_J[best_j] / (double)(copies_J[best_j] + n + 1) : 0.0;
    }
}

/* The devices holding a row's expert, ascending, into holders (D words); returns their count. Rows
 * are mostly zero (one owner, a few replicas): eight devices per zero word are skipped at once. */
static Py_ssize_t row_holders(const uint8_t *row_D, Py_ssize_t D, int64_t *holders)
{
    Py_ssize_t c = 0, d = 0;
    for (; d + 8 <= D; d += 8) {
        uint64_t word;
        memcpy(&word, row_D + d, sizeof word);
        if (word == 0) continue;
        for (Py_ssize_t i = 0; i < 8; i++)
            if (row_D[d + i]) holders[c++] = d + i;
    }
    for (; d < D; d++)
        if (row_D[d]) holders[c++] = d;
    return c;
}

/* Candidate order inside a node (l.10): modeled load ascending, then more free slots, then lower id. */
static inline int cand_before(int64_t a, int64_t b, const double *load_D, const int64_t *slots_D)
{
    if (flt_lt(load_D[a], load_D[b])) return 1;
    if (flt_lt(load_D[b], load_D[a])) return 0;
    if (slots_D[a] != slots_D[b]) return slots_D[a] > slots_D[b];
    return a < b;
}

/* One node's entry in l.10's merge: the key of its next candidate, (holders_n + j) / k_n (the integer
 * holders_n + j on a uniform topology; both exact in a double) and the candidate's modeled load, both as
 * `order_key`s, then the node. */
typedef struct {
    uint64_t level, load;
    int64_t node;
} merge_t;

/* A double as an unsigned integer of the same order as flt_lt's (numpy's): NaN after everything and all
 * NaNs equal, -0.0 equal to 0.0; integer comparisons then order the merge heap. */
static inline uint64_t order_key(double x)
{
    if (x != x) return UINT64_MAX;
    if (x == 0.0) x = 0.0;
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits >> 63 ? ~bits : bits | 0x8000000000000000ULL;
}

typedef struct {
    int64_t *copies_J, *room_J, *n_J;   /* [J] */
    double *load_J, *head_J;            /* [J] */
    int64_t *holders, *cand, *seq;      /* [D] */
    int64_t *holders_N, *cnt_N, *taken_N, *pos_N, *stamp_N;  /* [N] */
    merge_t *heap_N;                    /* [N] */
    int64_t *extra;                     /* [extra] words for the caller */
    /* Mask-free mode (place_replicas with mask_ED == NULL, from a shard): row is a zeroed [D] scratch
     * row standing in for the current expert's, and the placed replicas are appended to pick_X as
     * e * D + d (npicks of them). */
    uint8_t *row;
    int64_t *pick_X;
    Py_ssize_t npicks;
} scratch_t;

static void *alloc_scratch(scratch_t *s, Py_ssize_t J, Py_ssize_t D, Py_ssize_t N, Py_ssize_t extra)
{
    size_t words = 5 * (size_t)J + 3 * (size_t)D + 8 * (size_t)N + (size_t)extra + 1;
    int64_t *mem = (int64_t *)malloc(words * sizeof(int64_t));
    if (mem == NULL) return NULL;
    s->copies_J = mem;
    s->room_J = s->copies_J + J;
    s->n_J = s->room_J + J;
    s->load_J = (double *)(s->n_J + J);
    s->head_J = s->load_J + J;
    s->holders = (int64_t *)(s->head_J + J);
    s->cand = s->holders + D;
    s->seq = s->cand + D;
    s->holders_N = s->seq + D;
    s->cnt_N = s->holders_N + N;
    s->taken_N = s->cnt_N + N;
    s->pos_N = s->taken_N + N;
    s->stamp_N = s->pos_N + N;
    s->heap_N = (merge_t *)(s->stamp_N + N);
    s->extra = (int64_t *)(s->heap_N + N);
    s->row = NULL;
    s->pick_X = NULL;
    s->npicks = 0;
    return mem;
}

static inline int merge_lt(const merge_t *a, const merge_t *b)
{
    if (a->level != b->level) return a->level < b->level;
    if (a->load != b->load) return a->load < b->load;
    return a->node < b->node;
}

/* Restore the heap order of heap[0..size) below position i. */
static void merge_sift_down(merge_t *heap, Py_ssize_t i, Py_ssize_t size)
{
    const merge_t x = heap[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= size) break;
        if (c + 1 < size && merge_lt(&heap[c + 1], &heap[c])) c++;
        if (!merge_lt(&heap[c], &x)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = x;
}

static inline uint64_t merge_level(const topo_t *tp, const scratch_t *s, int64_t nn)
{
    const double level = (double)(s->holders_N[nn] + s->taken_N[nn]);
    return order_key(tp->uniform ? level : level / (double)tp->k_N[nn]);
}

/* Node nn's devices with a free slot in l.10's inner order (`cand_before`), cand[off_N[nn] ..) with
 * cnt_N[nn] of them: the listed devices that still have a slot, re-sorted (insertion: the list is
 * sorted but for the few devices whose load or slots changed). Devices without a slot never get one
 * back, so they leave the list for good. */
static void sort_node(const topo_t *tp, scratch_t *s, int64_t nn, const double *dev_load_D, const int64_t *slots_D)
{
    int64_t *list = s->cand + tp->off_N[nn];
    Py_ssize_t c = 0;
    for (Py_ssize_t i = 0; i < s->cnt_N[nn]; i++) {
        const int64_t d = list[i];
        if (slots_D[d] <= 0) continue;
        Py_ssize_t pos = c++;
        while (pos > 0 && cand_before(d, list[pos - 1], dev_load_D, slots_D)) {
            list[pos] = list[pos - 1];
            pos--;
        }
        list[pos] = d;
    }
    s->cnt_N[nn] = c;
}

/* The first position >= pos of node nn's list that is not a holder of the current expert (row_D). */
static inline Py_ssize_t next_candidate(const topo_t *tp, const scratch_t *s, int64_t nn, Py_ssize_t pos,
                                        const uint8_t *row_D)
{
    const int64_t *list = s->cand + tp->off_N[nn];
    while (pos < s->cnt_N[nn] && row_D[list[pos]]) pos++;
    return pos;
}

/* Alg. 1 l.7-11 (_place_replicas), in place on mask_ED, slots_D, copies_E and dev_load_D (the modeled
 * loads of cost.fluid_device_load, initialized by the caller). owners_E (may be NULL): the shard
 * owners when mask_ED is the shard placement itself.
 *
 * l.10's candidates are kept across experts: every node's devices with a free slot, in the inner order
 * (load, more free slots, id), sorted once; an expert's candidates are its node lists less its holders
 * (the order of a subset is the subset of the order), and after a placement only the nodes of the
 * expert's holders — the devices whose load or slots changed — are re-sorted. */
static void place_replicas(const topo_t *tp, uint8_t *mask_ED, const double *load_E,
                           const int64_t *experts_J, Py_ssize_t J, int64_t *slots_D, int64_t *copies_E,
                           double *dev_load_D, const int64_t *owners_E, scratch_t *s)
{
    const Py_ssize_t D = (Py_ssize_t)tp->D, N = (Py_ssize_t)tp->N;
    const int64_t *k_N = tp->k_N, *off_N = tp->off_N, *node_D = tp->node_D;
    int64_t total_slots = 0;
    int any_slot = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        total_slots += slots_D[d];
        any_slot |= slots_D[d] != 0;
    }
    if (J == 0 || !any_slot) return;
    for (Py_ssize_t j = 0; j < J; j++) {
        s->copies_J[j] = copies_E[experts_J[j]];
        s->room_J[j] = D - s->copies_J[j];
        s->load_J[j] = load_E[experts_J[j]];
    }
    assign_slots(s->load_J, s->copies_J, s->room_J, J, total_slots, s->n_J, s->head_J);      /* l.9 */
    Py_ssize_t listed = 0;              /* devices with a free slot: the lists' lengths */
    for (Py_ssize_t nn = 0; nn < N; nn++) {
        int64_t *list = s->cand + off_N[nn];
        s->cnt_N[nn] = k_N[nn];
        for (int64_t j = 0; j < k_N[nn]; j++) list[j] = off_N[nn] + j;
        sort_node(tp, s, nn, dev_load_D, slots_D);
        s->stamp_N[nn] = -1;
        listed += s->cnt_N[nn];
    }
    for (Py_ssize_t i = 0; i < J; i++) {                                          /* l.8 */
        const int64_t e = experts_J[i], n = s->n_J[i], copies = s->copies_J[i];
        if (n == 0) continue;
        const int mask_free = mask_ED == NULL;   /* then owners_E is given: the owner is e's one holder */
        uint8_t *row_D = mask_free ? s->row : mask_ED + (size_t)e * (size_t)D;
        Py_ssize_t num_holders;
        if (mask_free) {
            row_D[owners_E[e]] = 1;
            s->holders[0] = owners_E[e];
            num_holders = 1;
        } else {
            num_holders = row_holders(row_D, D, s->holders);
        }
        /* Candidates: no copy of e and a free slot, i.e. the listed devices less e's listed holders. */
        Py_ssize_t num_cand = listed;
        for (Py_ssize_t nn = 0; nn < N; nn++) s->holders_N[nn] = 0;
        for (Py_ssize_t h = 0; h < num_holders; h++) {
            s->holders_N[node_D[s->holders[h]]]++;
            num_cand -= slots_D[s->holders[h]] > 0;
        }
        if (num_cand == 0) {
            if (mask_free) row_D[owners_E[e]] = 0;
            continue;
        }
        /* l.10: merge the nodes' streams by (holders_n + j) / k_n, then the candidate's load, then node.
         * Every node's stream has strictly increasing keys, so the picks come off a heap of the nodes'
         * next candidates. Picks are drawn as the LPT guard below reads them; it usually stops long
         * before npick. */
        const Py_ssize_t npick = n < num_cand ? (Py_ssize_t)n : num_cand;
        Py_ssize_t size = 0;
        for (Py_ssize_t nn = 0; nn < N; nn++) {
            const Py_ssize_t pos = next_candidate(tp, s, nn, 0, row_D);
            if (pos >= s->cnt_N[nn]) continue;
            s->pos_N[nn] = pos;
            s->taken_N[nn] = 0;
            s->heap_N[size].level = merge_level(tp, s, nn);
            s->heap_N[size].load = order_key(dev_load_D[s->cand[off_N[nn] + pos]]);
            s->heap_N[size++].node = nn;
        }
        for (Py_ssize_t q = size / 2; q-- > 0;) merge_sift_down(s->heap_N, q, size);
        /* LPT guard: place the first k <= npick, k minimizing the hottest device among e's holders. */
        const double load_e = load_E[e];
        double hottest = dev_load_D[s->holders[0]];
        for (Py_ssize_t h = 0; h < num_holders; h++)
            if (dev_load_D[s->holders[h]] > hottest) hottest = dev_load_D[s->holders[h]];
        const double base = hottest - load_e / (double)copies;
        const double share_last = load_e / (double)(copies + npick);
        double best = hottest, run = -INFINITY;
        Py_ssize_t k = 0;
        for (Py_ssize_t j = 1; j <= npick; j++) {
            merge_t *top_node = &s->heap_N[0];                /* l.10: the next pick */
            const int64_t bn = top_node->node;
            s->seq[j - 1] = s->cand[off_N[bn] + s->pos_N[bn]];
            s->taken_N[bn]++;
            s->pos_N[bn] = next_candidate(tp, s, bn, s->pos_N[bn] + 1, row_D);
            if (s->pos_N[bn] >= s->cnt_N[bn]) {
                *top_node = s->heap_N[--size];
            } else {
                top_node->level = merge_level(tp, s, bn);
                top_node->load = order_key(dev_load_D[s->cand[off_N[bn] + s->pos_N[bn]]]);
            }
            if (size > 0) merge_sift_down(s->heap_N, 0, size);
            const double x = dev_load_D[s->seq[j - 1]];
            if (x > run) run = x;
            const double top = run > base ? run : base;
            if (top + share_last >= best) break;
            const double peak = top + load_e / (double)(copies + j);
            if (peak < best) {
                best = peak;
                k = j;
            }
        }
        if (mask_free) row_D[owners_E[e]] = 0;  /* the scratch row is read only above */
        if (k == 0) continue;
        /* l.11: P' ← P' ∪ P^e; the modeled load of every holder of e changes (cost.fluid_device_load:
         * load/D · (k_n / h_n + U / c) at a holder on node n, U = devices on nodes without e). */
        const double per_device = load_e / (double)D;
        int64_t uncovered = D;
        for (Py_ssize_t nn = 0; nn < N; nn++)
            if (s->holders_N[nn]) uncovered -= k_N[nn];
        double term = (double)uncovered / (double)copies;
        for (Py_ssize_t h = 0; h < num_holders; h++) {
            const int64_t d = s->holders[h], nd = node_D[d];
            dev_load_D[d] = dev_load_D[d] - per_device * ((double)k_N[nd] / (double)s->holders_N[nd] + term);
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            const int64_t d = s->seq[j], nd = node_D[d];
            if (mask_free)
                s->pick_X[s->npicks++] = e * (int64_t)D + d;
            else
                row_D[d] = 1;
            slots_D[d] -= 1;
            if (!s->holders_N[nd]) uncovered -= k_N[nd];
            s->holders_N[nd]++;
            s->holders[num_holders++] = d;
        }
        copies_E[e] = copies + k;
        term = (double)uncovered / (double)(copies + k);
        for (Py_ssize_t h = 0; h < num_holders; h++) {
            const int64_t d = s->holders[h], nd = node_D[d];
            dev_load_D[d] = dev_load_D[d] + per_device * ((double)k_N[nd] / (double)s->holders_N[nd] + term);
        }
        /* The holders' loads and the new holders' slots changed: re-sort their nodes' lists. */
        for (Py_ssize_t h = 0; h < num_holders; h++) {
            const int64_t nd = node_D[s->holders[h]];
            if (s->stamp_N[nd] == i) continue;
            s->stamp_N[nd] = i;
            listed -= s->cnt_N[nd];
            sort_node(tp, s, nd, dev_load_D, slots_D);
            listed += s->cnt_N[nd];
        }
    }
}

/* _shard_device_load's bincount: fluid_device_load of a shard placement on several nodes, experts in
 * ascending order (one holder: the per-holder factor is D exactly). */
static void shard_device_load(const int64_t *owners_E, const double *load_E, Py_ssize_t E, Py_ssize_t D,
                              double *out_D)
{
    for (Py_ssize_t d = 0; d < D; d++) out_D[d] = 0.0;
    for (Py_ssize_t e = 0; e < E; e++) out_D[owners_E[e]] += (load_E[e] / (double)D) * (double)D;
}

/* cost.fluid_device_load of any placement on several nodes, a sum over (expert, holder) pairs in
 * ascending expert order: a holder d of e on node n adds
 * load_e / D · (k_n / h_en + U_e / c_e), U_e = devices on nodes without e (a sum of small integers,
 * exact in any order), in the order of numpy's weighted bincount. With one holder the factor is
 * k_n / 1 + (D - k_n) / 1 = D exactly, as in shard_device_load. copies_E and owners_E (both NULL, or
 * the holder counts and, where one, the holder): what the caller already knows of the mask.
 * holders_N: [N] scratch, holders: [D] scratch. */
static void fluid_device_load_pairs(const topo_t *tp, const uint8_t *mask_ED, const double *load_E,
                                    Py_ssize_t E, const int64_t *copies_E, const int64_t *owners_E,
                                    double *out_D, int64_t *holders_N, int64_t *holders)
{
    const Py_ssize_t D = (Py_ssize_t)tp->D, N = (Py_ssize_t)tp->N;
    for (Py_ssize_t d = 0; d < D; d++) out_D[d] = 0.0;
    for (Py_ssize_t e = 0; e < E; e++) {
        if (copies_E != NULL && copies_E[e] == 1) {
            out_D[owners_E[e]] += (load_E[e] / (double)D) * (double)D;
            continue;
        }
        const Py_ssize_t copies = row_holders(mask_ED + (size_t)e * (size_t)D, D, holders);
        if (copies == 0) continue;
        for (Py_ssize_t nn = 0; nn < N; nn++) holders_N[nn] = 0;
        for (Py_ssize_t h = 0; h < copies; h++) holders_N[tp->node_D[holders[h]]]++;
        double uncovered = 0.0;
        for (Py_ssize_t nn = 0; nn < N; nn++)
            if (holders_N[nn] == 0) uncovered += (double)tp->k_N[nn];
        const double spread = uncovered / (double)copies, per_device = load_E[e] / (double)D;
        for (Py_ssize_t h = 0; h < copies; h++) {
            const int64_t d = holders[h], nd = tp->node_D[d];
            out_D[d] += per_device * ((double)tp->k_N[nd] / (double)holders_N[nd] + spread);
        }
    }
}

/* fluid_device_load(topology, mask_ED, load_E, out_D (w)) -> None: the pair sum alone (for tests). */
static PyObject *py_fluid_device_load(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bmask, bload, bout;
    PyObject *result = NULL;
    int64_t *holders_N = NULL;
    topo_t tp;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &btopo, &bmask, &bload, &bout)) return NULL;
    if (parse_topo(&btopo, &tp) < 0) goto done;
    const Py_ssize_t E = bload.len / (Py_ssize_t)sizeof(double);
    if (check_len(&bmask, E * (Py_ssize_t)tp.D, 1, "mask_ED") < 0 || check_len(&bout, (Py_ssize_t)tp.D, 8, "out_D") < 0)
        goto done;
    holders_N = (int64_t *)malloc(((size_t)tp.N + (size_t)tp.D) * sizeof(int64_t));
    if (holders_N == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    fluid_device_load_pairs(&tp, (const uint8_t *)bmask.buf, (const double *)bload.buf, E, NULL, NULL,
                            (double *)bout.buf, holders_N, holders_N + tp.N);
    result = Py_None;
    Py_INCREF(result);
done:
    free(holders_N);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bmask);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bout);
    return result;
}

/* place_replicas(topology, mask_ED (w), load_E, experts_J, slots_D (w), copies_E (w),
 *                dev_load_D (w) or None, owners_E or None) -> None
 * dev_load_D None: the initial modeled loads are `fluid_device_load_pairs` of mask_ED (the caller
 * checked that this is the model's own sum). */
static PyObject *py_place_replicas(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bmask, bload, bexp, bslots, bcopies, bdev = {0}, bown = {0};
    PyObject *owners_obj, *dev_obj, *result = NULL;
    topo_t tp;
    scratch_t s;
    void *mem = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*w*w*OO", &btopo, &bmask, &bload, &bexp, &bslots, &bcopies, &dev_obj,
                          &owners_obj))
        return NULL;
    int have_owners = owners_obj != Py_None, have_dev = dev_obj != Py_None;
    if (have_owners && PyObject_GetBuffer(owners_obj, &bown, PyBUF_SIMPLE) < 0) goto done;
    if (have_dev && PyObject_GetBuffer(dev_obj, &bdev, PyBUF_WRITABLE) < 0) goto done;
    if (parse_topo(&btopo, &tp) < 0) goto done;
    Py_ssize_t D = (Py_ssize_t)tp.D, E = bload.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t J = bexp.len / (Py_ssize_t)sizeof(int64_t);
    if (check_len(&bmask, E * D, 1, "mask_ED") < 0 || check_len(&bslots, D, 8, "slots_D") < 0 ||
        check_len(&bcopies, E, 8, "copies_E") < 0 || (have_dev && check_len(&bdev, D, 8, "dev_load_D") < 0) ||
        (have_owners && check_len(&bown, E, 8, "owners_E") < 0))
        goto done;
    mem = alloc_scratch(&s, J, D, (Py_ssize_t)tp.N, D);
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *dev_load_D = have_dev ? (double *)bdev.buf : (double *)s.extra;
    if (!have_dev)
        fluid_device_load_pairs(&tp, (const uint8_t *)bmask.buf, (const double *)bload.buf, E, NULL, NULL,
                                dev_load_D, s.holders_N, s.holders);
    place_replicas(&tp, (uint8_t *)bmask.buf, (const double *)bload.buf, (const int64_t *)bexp.buf, J,
                   (int64_t *)bslots.buf, (int64_t *)bcopies.buf, dev_load_D,
                   have_owners ? (const int64_t *)bown.buf : NULL, &s);
    result = Py_None;
    Py_INCREF(result);
done:
    free(mem);
    if (bown.obj != NULL) PyBuffer_Release(&bown);
    if (bdev.obj != NULL) PyBuffer_Release(&bdev);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bmask);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bexp);
    PyBuffer_Release(&bslots);
    PyBuffer_Release(&bcopies);
    return result;
}

/* materialize(topology, owners_E, load_E, t, m, mask_ED (w), copies_E (w), dev_load_D (w) or None)
 *     -> int
 * sparse_materialization after its shard and count checks, t and m already capped (l.1). mask_ED: a
 * copy of the shard mask; copies_E: the holder counts, written here (ones, then the replicas). dev_load_D: the initial modeled loads for the LPT branch when
 * they are not the bincount of `shard_device_load` (None: computed here). Returns -1 when a load is
 * negative, NaN or infinite (nothing written), 0 when P' = P (no top expert, or m = 0), else 1. */
static PyObject *py_materialize(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bown, bload, bmask, bcopies, bdev = {0};
    Py_ssize_t t, m;
    PyObject *dev_obj;
    topo_t tp;
    scratch_t s;
    void *mem = NULL;
    long rc = -2;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*nnw*w*O", &btopo, &bown, &bload, &t, &m, &bmask, &bcopies, &dev_obj))
        return NULL;
    int have_dev = dev_obj != Py_None;
    if (have_dev && PyObject_GetBuffer(dev_obj, &bdev, PyBUF_WRITABLE) < 0) goto done;
    if (parse_topo(&btopo, &tp) < 0) goto done;
    Py_ssize_t D = (Py_ssize_t)tp.D, N = (Py_ssize_t)tp.N, E = bload.len / (Py_ssize_t)sizeof(double);
    if (check_len(&bown, E, 8, "owners_E") < 0 || check_len(&bmask, E * D, 1, "mask_ED") < 0 ||
        check_len(&bcopies, E, 8, "copies_E") < 0 || (have_dev && check_len(&bdev, D, 8, "dev_load_D") < 0))
        goto done;
    const double *load_E = (const double *)bload.buf;
    for (Py_ssize_t e = 0; e < E; e++)   /* check_loads' fast accept: finite and >= 0 */
        if (!(load_E[e] >= 0 && load_E[e] < INFINITY)) {
            rc = -1;
            goto done;
        }
    int64_t *copies_E = (int64_t *)bcopies.buf;
    for (Py_ssize_t e = 0; e < E; e++) copies_E[e] = 1;   /* a shard placement: one holder each */
    if (t > E) t = E;
    if (m > t) m = t;
    /* J <= t; the scratch's extra words hold the top list, the free slots and the modeled loads. */
    mem = alloc_scratch(&s, t, D, N, t + 2 * D);
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *top_J = s.extra, *slots_D = top_J + t;
    double *dev_load_D = have_dev ? (double *)bdev.buf : (double *)(slots_D + D);
    Py_ssize_t J = top_experts(load_E, E, t, NULL, top_J);                          /* l.3 */
    if (J < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (J == 0 || m == 0) {
        rc = 0;
        goto done;
    }
    uint8_t *mask_ED = (uint8_t *)bmask.buf;
    if (t <= m) {                                                                   /* l.4-5 */
        for (Py_ssize_t j = 0; j < J; j++) {
            memset(mask_ED + (size_t)top_J[j] * (size_t)D, 1, (size_t)D);
            copies_E[top_J[j]] = D;
        }
    } else {                                                                        /* l.7-11 */
        for (Py_ssize_t d = 0; d < D; d++) slots_D[d] = m;
        if (!have_dev) shard_device_load((const int64_t *)bown.buf, load_E, E, D, dev_load_D);
        place_replicas(&tp, mask_ED, load_E, top_J, J, slots_D, copies_E, dev_load_D,
                       (const int64_t *)bown.buf, &s);
    }
    rc = 1;
done:
    free(mem);
    if (have_dev && bdev.obj != NULL) PyBuffer_Release(&bdev);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bown);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bmask);
    PyBuffer_Release(&bcopies);
    if (rc == -2) return NULL;
    return PyLong_FromLong(rc);
}

/* assign_slots(load_J, copies_J, room_J, total_slots, n_J (w)) -> None: l.9 alone (for tests). */
static PyObject *py_assign_slots(PyObject *self, PyObject *args)
{
    Py_buffer bload, bcopies, broom, bout;
    long long total;
    PyObject *result = NULL;
    double *head_J = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*Lw*", &bload, &bcopies, &broom, &total, &bout)) return NULL;
    const Py_ssize_t J = bload.len / (Py_ssize_t)sizeof(double);
    if (check_len(&bcopies, J, 8, "copies_J") < 0 || check_len(&broom, J, 8, "room_J") < 0 ||
        check_len(&bout, J, 8, "n_J") < 0)
        goto done;
    head_J = (double *)malloc((size_t)(J > 0 ? J : 1) * sizeof(double));
    if (head_J == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    assign_slots((const double *)bload.buf, (const int64_t *)bcopies.buf, (const int64_t *)broom.buf, J,
                 (int64_t)total, (int64_t *)bout.buf, head_J);
    result = Py_None;
    Py_INCREF(result);
done:
    free(head_J);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bcopies);
    PyBuffer_Release(&broom);
    PyBuffer_Release(&bout);
    return result;
}

/* ------------------------------------------------------------------------------------ Alg. 3 */
/* One expert's holders, ascending, and where each node's holders start in that list (devices are
 * numbered node by node, so a node's holders are a contiguous run). */
typedef struct {
    int64_t *holders;   /* [D] */
    int64_t *count_N;   /* [N] holders on node n */
    int64_t *start_N;   /* [N] index of node n's first holder in `holders` */
} holders_t;

static Py_ssize_t find_holders(const topo_t *tp, const uint8_t *row_D, holders_t *h)
{
    const Py_ssize_t c = row_holders(row_D, (Py_ssize_t)tp->D, h->holders);
    /* Devices are numbered node by node, so every node's holders are a contiguous run. */
    Py_ssize_t i = 0;
    for (int64_t nn = 0; nn < tp->N; nn++) {
        h->start_N[nn] = i;
        while (i < c && h->holders[i] < tp->off_N[nn + 1]) i++;
        h->count_N[nn] = i - h->start_N[nn];
    }
    return c;
}

/* Alg. 3 l.4-12 for one (expert e, source d) with at least two holders: R[e, d, :] into out_D (zeroed).
 * Even split with the module's remainder rule: target j of k receives q + 1 when (j - (e + d)) mod k < r. */
static inline void split_row(const topo_t *tp, int64_t e, int64_t d, int64_t tokens, const uint8_t *row_D,
                             const holders_t *h, Py_ssize_t copies, int64_t *out_D)
{
    if (row_D[d]) {                                  /* l.4-5: a holder keeps its tokens */
        out_D[d] = tokens;
        return;
    }
    const int64_t nd = tp->node_D[d];
    const int64_t *targets;
    int64_t k;
    if (h->count_N[nd] > 0) {                         /* l.9-10: intra-node */
        targets = h->holders + h->start_N[nd];
        k = h->count_N[nd];
    } else {                                         /* l.12: all holders */
        targets = h->holders;
        k = copies;
    }
    const int64_t q = tokens / k, r = tokens % k, offset = (e + d) % k;
    for (int64_t j = 0; j < k; j++) {
        int64_t u = j - offset;
        if (u < 0) u += k;
        out_D[targets[j]] = q + (u < r);
    }
}

/* q, r = divmod(tokens, k) for tokens >= 0 and 1 <= k <= D, inv_k = 1.0 / k. Below 2^32 tokens the
 * product tokens · inv_k is within 2^-20 of tokens / k, so its integer part is q or one off, which the
 * remainder's range corrects (without branches: the off-by-one is data-dependent); larger counts
 * divide. */
static inline void divmod_count(int64_t tokens, int64_t k, double inv_k, int64_t *q, int64_t *r)
{
    if ((uint64_t)tokens <= 0xFFFFFFFFu) {
        int64_t qq = (int64_t)((double)tokens * inv_k), rr = tokens - qq * k;
        const int64_t under = rr < 0, over = rr >= k;
        *q = qq - under + over;
        *r = rr + (k & -under) - (k & -over);
    } else {
        *q = tokens / k;
        *r = tokens % k;
    }
}

/* Alg. 3 for one expert e with copies >= 1 holders (h), summed per destination into out_D: the tokens
 * every device computes for e. tok_e[d * sd] = T[e, d] >= 0. Node by node: a node's sources share
 * their k targets (l.9-12) and the remainder offset (e + d) mod k advances by one per source, so the
 * node's quotients are summed and its remainder windows [offset, offset + r) (mod k) counted in a
 * difference array, then added to the targets at once (exact integer sums: the same totals as the
 * source-by-source plan). The per-source steps avoid branches (holders, zero counts and wrapping
 * windows come in no predictable pattern). diff: [D + 1] scratch. */
static void add_expert_load(const topo_t *tp, int64_t e, const uint8_t *row_D, const int64_t *tok_e,
                            Py_ssize_t sd, const holders_t *h, Py_ssize_t copies, int64_t *out_D, int64_t *diff)
{
    if (copies == 1) {
        const Py_ssize_t D = (Py_ssize_t)tp->D;
        int64_t sum = 0;
        for (Py_ssize_t d = 0; d < D; d++) sum += tok_e[d * sd];
        out_D[h->holders[0]] += sum;
        return;
    }
    for (int64_t nn = 0; nn < tp->N; nn++) {
        const int64_t lo = tp->off_N[nn], hi = tp->off_N[nn + 1];
        const int local = h->count_N[nn] > 0;
        const int64_t *targets = local ? h->holders + h->start_N[nn] : h->holders;
        const int64_t k = local ? h->count_N[nn] : (int64_t)copies;
        if (local && k == hi - lo) {                      /* every source holds e: l.4-5 only */
            for (int64_t d = lo; d < hi; d++) out_D[d] += tok_e[d * sd];
            continue;
        }
        const double inv_k = 1.0 / (double)k;
        int64_t offset = (e + lo) % k, quotients = 0;
        memset(diff, 0, (size_t)(k + 1) * sizeof(int64_t));
        for (int64_t d = lo; d < hi; d++, offset = offset + 1 == k ? 0 : offset + 1) {
            const int64_t tokens = tok_e[d * sd], held = -(int64_t)(row_D[d] != 0);
            out_D[d] += tokens & held;                    /* l.4-5: a holder keeps its tokens */
            int64_t q, r;
            divmod_count(tokens & ~held, k, inv_k, &q, &r);
            quotients += q;
            /* targets offset .. offset + r - 1, wrapping at k (r = 0: +1 and -1 at offset) */
            const int64_t end = offset + r, wrap = end > k;
            diff[offset]++;
            diff[0] += wrap;
            diff[end - (k & -wrap)]--;
        }
        int64_t extra = 0;
        for (int64_t j = 0; j < k; j++) {
            extra += diff[j];
            out_D[targets[j]] += quotients + extra;
        }
    }
}

typedef enum { PLAN_FULL, PLAN_ROWS, PLAN_LOAD } plan_kind;

/* The OR of every count T[e, d] = tokens_ED[e * se + d * sd] (negative iff a count is) and, with sum_E,
 * every expert's total, walking the buffer in its memory order: the counts arrive transposed from the
 * gather of per-device counts, and a walk expert by expert would stride across the whole buffer.
 * Integer sums: exact in any order. */
static int64_t scan_tokens(const int64_t *tokens_ED, Py_ssize_t se, Py_ssize_t sd, Py_ssize_t E, Py_ssize_t D,
                           int64_t *sum_E)
{
    int64_t bits = 0;
    const Py_ssize_t ase = se < 0 ? -se : se, asd = sd < 0 ? -sd : sd;
    if (ase >= asd) {                                  /* rows (experts) outer */
        for (Py_ssize_t e = 0; e < E; e++) {
            const int64_t *tok_e = tokens_ED + e * se;
            int64_t sum = 0, or_e = 0;
            for (Py_ssize_t d = 0; d < D; d++) {
                const int64_t v = tok_e[d * sd];
                or_e |= v;
                sum += v;
            }
            bits |= or_e;
            if (sum_E != NULL) sum_E[e] = sum;
        }
    } else {                                           /* devices outer: the transposed layout */
        if (sum_E != NULL) memset(sum_E, 0, (size_t)E * sizeof(int64_t));
        for (Py_ssize_t d = 0; d < D; d++) {
            const int64_t *tok_d = tokens_ED + d * sd;
            if (sum_E != NULL)
                for (Py_ssize_t e = 0; e < E; e++) {
                    const int64_t v = tok_d[e * se];
                    bits |= v;
                    sum_E[e] += v;
                }
            else
                for (Py_ssize_t e = 0; e < E; e++) bits |= tok_d[e * se];
        }
    }
    return bits;
}

/* The three Alg. 3 entry points share this loop. PLAN_FULL: out = R [E, D, D]; PLAN_ROWS: out =
 * R[:, sources, :] as [E, S, D] (both written entirely: every expert's slab is zeroed just before its
 * entries, while it is in cache); PLAN_LOAD: out = [D] tokens each device computes (zeroed here). */
static long plan(const topo_t *tp, const uint8_t *mask_ED, const int64_t *tokens_ED, Py_ssize_t se,
                 Py_ssize_t sd, Py_ssize_t E, plan_kind kind, const int64_t *sources_S, Py_ssize_t S,
                 int64_t *out)
{
    const Py_ssize_t D = (Py_ssize_t)tp->D, N = (Py_ssize_t)tp->N;
    long rc = 0;
    int64_t *mem = (int64_t *)malloc(((size_t)D * 2 + (size_t)N * 2 + 1 + (size_t)E) * sizeof(int64_t));
    if (mem == NULL) return -1;
    holders_t h = {mem, mem + D, mem + D + N};
    int64_t *diff = mem + D + 2 * N;   /* D + 1 words */
    int64_t *sum_E = diff + D + 1;     /* E words: every expert's tokens (PLAN_LOAD) */
    /* Negative counts are rejected before any output (the caller then raises numpy's precise error). */
    if (scan_tokens(tokens_ED, se, sd, E, D, kind == PLAN_LOAD ? sum_E : NULL) < 0) {
        free(mem);
        return 1;
    }
    if (kind == PLAN_LOAD) memset(out, 0, (size_t)D * sizeof(int64_t));
    for (Py_ssize_t e = 0; e < E && rc == 0; e++) {
        const uint8_t *row_D = mask_ED + (size_t)e * (size_t)D;
        const int64_t *tok_e = tokens_ED + e * se;      /* T[e, d] = tok_e[d * sd] */
        const Py_ssize_t copies = find_holders(tp, row_D, &h);
        if (kind == PLAN_FULL)
            memset(out + (size_t)e * (size_t)D * (size_t)D, 0, (size_t)D * (size_t)D * sizeof(int64_t));
        else if (kind == PLAN_ROWS)
            memset(out + (size_t)e * (size_t)S * (size_t)D, 0, (size_t)S * (size_t)D * sizeof(int64_t));
        if (copies == 0) {                            /* tokens for an expert nobody holds? */
            int64_t bits = 0;
            for (Py_ssize_t d = 0; d < D; d++) bits |= tok_e[d * sd];
            if (bits) rc = 2;
            continue;
        }
        if (kind == PLAN_FULL) {
            int64_t *R_DD = out + (size_t)e * (size_t)D * (size_t)D;
            if (copies == 1) {                        /* every token goes to the one holder */
                const int64_t owner = h.holders[0];
                for (Py_ssize_t d = 0; d < D; d++) R_DD[(size_t)d * D + owner] = tok_e[d * sd];
            } else {
                for (Py_ssize_t d = 0; d < D; d++)
                    split_row(tp, e, d, tok_e[d * sd], row_D, &h, copies, R_DD + (size_t)d * D);
            }
        } else if (kind == PLAN_ROWS) {
            int64_t *R_SD = out + (size_t)e * (size_t)S * (size_t)D;
            for (Py_ssize_t i = 0; i < S; i++) {
                const int64_t d = sources_S[i];
                if (copies == 1)
                    R_SD[(size_t)i * D + h.holders[0]] = tok_e[d * sd];
                else
                    split_row(tp, e, d, tok_e[d * sd], row_D, &h, copies, R_SD + (size_t)i * D);
            }
        } else if (copies == 1) {                     /* every token goes to the one holder */
            out[h.holders[0]] += sum_E[e];
        } else {
            add_expert_load(tp, e, row_D, tok_e, sd, &h, copies, out, diff);
        }
    }
    free(mem);
    return rc;
}

static PyObject *run_plan(PyObject *args, plan_kind kind)
{
    Py_buffer btopo, bmask, bout, btok = {0}, bsrc = {0};
    PyObject *src_obj = Py_None, *tok_obj;
    topo_t tp;
    long rc = -1;
    int64_t single = 0;
    const int64_t *sources_S = NULL;
    Py_ssize_t S = 0;
    Py_ssize_t E;
    if (kind == PLAN_ROWS) {
        if (!PyArg_ParseTuple(args, "y*y*OnOw*", &btopo, &bmask, &tok_obj, &E, &src_obj, &bout)) return NULL;
    } else if (!PyArg_ParseTuple(args, "y*y*Onw*", &btopo, &bmask, &tok_obj, &E, &bout)) {
        return NULL;
    }
    if (parse_topo(&btopo, &tp) < 0) goto done;
    /* Token counts: any 2-D strided int64 buffer (numpy's transposed counts need no copy). */
    if (PyObject_GetBuffer(tok_obj, &btok, PyBUF_STRIDES) < 0) goto done;
    if (btok.ndim != 2 || btok.itemsize != 8 || btok.strides[0] % 8 || btok.strides[1] % 8) {
        PyErr_SetString(PyExc_ValueError, "_cplan: tokens must be a 2-D int64 buffer");
        goto done;
    }
    if (E < 0 || bmask.len != E * (Py_ssize_t)tp.D || btok.shape[0] != E || btok.shape[1] != tp.D) {
        rc = 3;       /* the topology's D is not the placement's (or the buffers disagree) */
        goto done;
    }
    if (kind == PLAN_ROWS) {
        if (PyLong_Check(src_obj)) {
            single = PyLong_AsLongLong(src_obj);
            if (single == -1 && PyErr_Occurred()) goto done;
            sources_S = &single;
            S = 1;
        } else {
            if (PyObject_GetBuffer(src_obj, &bsrc, PyBUF_SIMPLE) < 0) goto done;
            sources_S = (const int64_t *)bsrc.buf;
            S = bsrc.len / (Py_ssize_t)sizeof(int64_t);
        }
        for (Py_ssize_t i = 0; i < S; i++)
            if (sources_S[i] < 0 || sources_S[i] >= tp.D) {
                PyErr_SetString(PyExc_ValueError, "_cplan: a source is out of range");
                goto done;
            }
    }
    const Py_ssize_t expected = kind == PLAN_FULL ? E * tp.D * tp.D : kind == PLAN_ROWS ? E * S * tp.D : tp.D;
    if (check_len(&bout, expected, 8, "out") < 0) goto done;
    rc = plan(&tp, (const uint8_t *)bmask.buf, (const int64_t *)btok.buf, btok.strides[0] / 8,
              btok.strides[1] / 8, E, kind, sources_S, S, (int64_t *)bout.buf);
    if (rc < 0) PyErr_NoMemory();
done:
    if (bsrc.obj != NULL) PyBuffer_Release(&bsrc);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bmask);
    if (btok.obj != NULL) PyBuffer_Release(&btok);
    PyBuffer_Release(&bout);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(rc);
}

/* dispatch(topology, mask_ED, tokens_ED, E, R_EDD (w)) -> int */
static PyObject *py_dispatch(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plan(args, PLAN_FULL);
}

/* dispatch_rows(topology, mask_ED, tokens_ED, E, sources (int or int64 buffer), R_ESD (w)) -> int */
static PyObject *py_dispatch_rows(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plan(args, PLAN_ROWS);
}

/* dispatch_device_load(topology, mask_ED, tokens_ED, E, load_D (w)) -> int */
static PyObject *py_dispatch_device_load(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plan(args, PLAN_LOAD);
}

/* ------------------------------------------------------------------------------------ calibration */
/* Calibration's l.8 order: ids by load descending, ties by lower id (cmp_top's order). */
static int sort_by_load(int64_t *ids, Py_ssize_t n, const double *load_E)
{
    if (n <= 32) {
        for (Py_ssize_t i = 1; i < n; i++) {
            const int64_t x = ids[i];
            Py_ssize_t pos = i;
            while (pos > 0 && (load_E[ids[pos - 1]] < load_E[x] ||
                               (load_E[ids[pos - 1]] == load_E[x] && ids[pos - 1] > x))) {
                ids[pos] = ids[pos - 1];
                pos--;
            }
            ids[pos] = x;
        }
        return 0;
    }
    keyed_t *keyed = (keyed_t *)malloc((size_t)n * sizeof(keyed_t));
    if (keyed == NULL) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        keyed[i].load = load_E[ids[i]];
        keyed[i].id = ids[i];
    }
    qsort(keyed, (size_t)n, sizeof(keyed_t), cmp_top);
    for (Py_ssize_t i = 0; i < n; i++) ids[i] = keyed[i].id;
    free(keyed);
    return 0;
}

/* Calibration's step 1 remainder and l.8 rows, for either calibration: slots_D (the replicas added per
 * device) becomes the remaining budget max(m - added, 0); when some device has a slot and the overlap
 * degree leaves room (t - replicated >= 0), experts_J gets every replicated expert and the
 * t - replicated highest-load others, those with load, by load descending (ties: lower id), at most t
 * of them (rep_J, fresh_J: scratch of t entries). Returns their number (0: nothing to place), -1 with
 * no memory. */
static Py_ssize_t eligible_rows(int64_t *slots_D, Py_ssize_t D, Py_ssize_t m, Py_ssize_t t, Py_ssize_t replicated,
                                const double *load_E, Py_ssize_t E, const uint8_t *replicated_E,
                                int64_t *rep_J, int64_t *fresh_J, int64_t *experts_J)
{
    int any_slot = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        slots_D[d] = slots_D[d] < m ? m - slots_D[d] : 0;
        any_slot |= slots_D[d] != 0;
    }
    const Py_ssize_t new_allowed = t - replicated;
    if (!any_slot || new_allowed < 0) return 0;
    Py_ssize_t num_rep = 0;
    for (Py_ssize_t e = 0; e < E; e++)
        if (replicated_E[e] && load_E[e] > 0) rep_J[num_rep++] = e;
    const Py_ssize_t num_fresh = top_experts(load_E, E, new_allowed, replicated_E, fresh_J);
    if (num_fresh < 0 || sort_by_load(rep_J, num_rep, load_E) < 0) return -1;
    Py_ssize_t J = 0, i = 0, j = 0;
    while (i < num_rep || j < num_fresh) {
        int take_rep = j >= num_fresh;
        if (i < num_rep && j < num_fresh) {
            const double a = load_E[rep_J[i]], b = load_E[fresh_J[j]];
            take_rep = a > b || (a == b && rep_J[i] < fresh_J[j]);
        }
        experts_J[J++] = take_rep ? rep_J[i++] : fresh_J[j++];
    }
    return J;
}

/* Sum of eight 0/1 bytes. */
static inline int64_t byte_sum(uint64_t word)
{
    return (int64_t)((word * 0x0101010101010101ULL) >> 56);
}

/* Whether row_D has a holder among devices lo .. hi - 1. */
static inline int any_in(const uint8_t *row_D, int64_t lo, int64_t hi)
{
    for (int64_t d = lo; d < hi; d++)
        if (row_D[d]) return 1;
    return 0;
}

/* cost.transfer_time(base, target) for target ⊇ base, on the cost's topology ctp: the most chunks a
 * device receives times Ψ / bw_intra against the most chunks newly entering a node times Ψ / bw_inter,
 * the larger of the two (Python's max: the second only when strictly larger); 0.0 without receives.
 * changed_E: the experts whose rows differ; recv_D, entries_N: scratch. */
static double transfer_time(const topo_t *ctp, const uint8_t *base_ED, const uint8_t *target_ED, Py_ssize_t E,
                            const uint8_t *changed_E, double expert_bytes, double intra_bw, double inter_bw,
                            int64_t *recv_D, int64_t *entries_N)
{
    const Py_ssize_t D = (Py_ssize_t)ctp->D, N = (Py_ssize_t)ctp->N;
    memset(recv_D, 0, (size_t)D * sizeof(int64_t));
    memset(entries_N, 0, (size_t)N * sizeof(int64_t));
    for (Py_ssize_t e = 0; e < E; e++) {
        if (!changed_E[e]) continue;                         /* nothing new for e */
        const uint8_t *b_D = base_ED + (size_t)e * (size_t)D, *p_D = target_ED + (size_t)e * (size_t)D;
        for (Py_ssize_t d = 0; d < D; d++) recv_D[d] += p_D[d] & !b_D[d];
        for (Py_ssize_t nn = 0; nn < N; nn++) {
            const int64_t lo = ctp->off_N[nn], hi = ctp->off_N[nn + 1];
            if (any_in(p_D, lo, hi) && !any_in(b_D, lo, hi)) entries_N[nn]++;
        }
    }
    int64_t max_recv = 0, max_entries = 0;
    for (Py_ssize_t d = 0; d < D; d++)
        if (recv_D[d] > max_recv) max_recv = recv_D[d];
    if (max_recv == 0) return 0.0;
    for (Py_ssize_t nn = 0; nn < N; nn++)
        if (entries_N[nn] > max_entries) max_entries = entries_N[nn];
    const double device_s = (double)max_recv * expert_bytes / intra_bw;
    const double node_s = (double)max_entries * expert_bytes / inter_bw;
    return node_s > device_s ? node_s : device_s;
}

/* sum_E += col_E and or_E |= col_E, elementwise (the pointers do not alias: vectorized). */
static void add_column(const int64_t *restrict col_E, Py_ssize_t E, int64_t *restrict sum_E, int64_t *restrict or_E)
{
    for (Py_ssize_t e = 0; e < E; e++) {
        sum_E[e] += col_E[e];
        or_E[e] |= col_E[e];
    }
}

static int64_t max_of(const int64_t *x_D, Py_ssize_t D)
{
    int64_t best = x_D[0];
    for (Py_ssize_t d = 1; d < D; d++)
        if (x_D[d] > best) best = x_D[d];
    return best;
}

/* calibrate(topology, cost_topology, shard_ED, materialized_ED, load_E, int_loads, t, m, tokens_ED,
 *           dev_load_D or None, expert_bytes, intra_bw, inter_bw, budget_s, time_per_token_s,
 *           mask_ED (w), copies_E (w)) -> (code, before_s, after_s, extra_s)
 *
 * materialize.calibrate with the Alg. 3 compute model, after its shard and count checks (t and m
 * capped as there). load_E: float64, or int64 when int_loads is true (converted here as numpy casts). Step 1 re-runs l.8-11 from the materialized mask with the remaining slots and
 * overlap degree into mask_ED / copies_E; step 2 weighs the merged placement as calibrate does, with
 * the same float operations: cost.transfer_time on the cost's topology (intra_bw, inter_bw its
 * bandwidths), the budget, straggler_time of both placements' Alg. 3 device loads.
 * dev_load_D: the materialized placement's modeled loads when they are not `fluid_device_load_pairs`
 * (None: computed here).
 * code: 0 keep the materialized placement; 1 adopt mask_ED / copies_E; negative when the inputs are for
 * the numpy code to judge (and to reject with the precise ValueError): -1 a load is negative, NaN or
 * infinite; -2 the shard is not contained in the materialized placement; -3 a token count is negative;
 * -4 buffers or topologies do not match. The times are those compared (0.0 where not reached). */
static PyObject *py_calibrate(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bctopo, bshard, bmat, bload, bmask, bcopies, btok = {0}, bdev = {0};
    Py_ssize_t t, m;
    PyObject *tok_obj, *dev_obj;
    double expert_bytes, intra_bw, inter_bw, budget_s, time_per_token_s;
    double before_s = 0.0, after_s = 0.0, extra_s = 0.0;
    topo_t tp, ctp;
    scratch_t s;
    void *mem = NULL;
    long code = -4;
    int failed = 1;
    (void)self;
    int int_loads;
    double *converted_E = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*pnnOOdddddw*w*", &btopo, &bctopo, &bshard, &bmat, &bload, &int_loads,
                          &t, &m, &tok_obj, &dev_obj, &expert_bytes, &intra_bw, &inter_bw, &budget_s,
                          &time_per_token_s, &bmask, &bcopies))
        return NULL;
    const int have_dev = dev_obj != Py_None;
    if (have_dev && PyObject_GetBuffer(dev_obj, &bdev, PyBUF_WRITABLE) < 0) goto done;
    if (parse_topo(&btopo, &tp) < 0 || parse_topo(&bctopo, &ctp) < 0) goto done;
    if (PyObject_GetBuffer(tok_obj, &btok, PyBUF_STRIDES) < 0) goto done;
    const Py_ssize_t D = (Py_ssize_t)tp.D, N = (Py_ssize_t)tp.N, E = bload.len / 8;
    failed = 0;
    if (bshard.len != E * D || bmat.len != E * D || bmask.len != E * D || bcopies.len != E * 8 ||
        (have_dev && bdev.len != D * 8) || btok.ndim != 2 || btok.itemsize != 8 || btok.strides[0] % 8 ||
        btok.strides[1] % 8 || btok.shape[0] != E || btok.shape[1] != D || t < 0 || m < 0)
        goto done;                                                   /* code -4 */
    const double *load_E = (const double *)bload.buf;
    if (int_loads) {                     /* int64 loads, converted as numpy's cast does */
        converted_E = (double *)malloc((size_t)(E > 0 ? E : 1) * sizeof(double));
        if (converted_E == NULL) {
            failed = 1;
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t e = 0; e < E; e++) converted_E[e] = (double)((const int64_t *)bload.buf)[e];
        load_E = converted_E;
    }
    for (Py_ssize_t e = 0; e < E; e++)   /* check_loads' fast accept: finite and >= 0 */
        if (!(load_E[e] >= 0 && load_E[e] < INFINITY)) {
            code = -1;
            goto done;
        }
    /* J <= t experts. Extra words: the replicated and fresh lists and J (3t); the free slots, the
     * modeled loads, three device-load vectors and Alg. 3's difference array (6D + 1); the cost
     * topology's node entries; per expert
     * its owner, its holders in P', T's row sum and row OR (4E); two flags per expert (bytes). */
    mem = alloc_scratch(&s, t, D, N, 3 * t + 6 * D + 1 + ctp.N + 4 * E + (2 * E + 7) / 8);
    if (mem == NULL) {
        failed = 1;
        PyErr_NoMemory();
        goto done;
    }
    int64_t *rep_J = s.extra, *fresh_J = rep_J + t, *experts_J = fresh_J + t, *slots_D = experts_J + t;
    double *dev_load_D = have_dev ? (double *)bdev.buf : (double *)(slots_D + D);
    int64_t *before_D = slots_D + 2 * D, *after_D = before_D + D, *delta_D = after_D + D;
    int64_t *diff = delta_D + D, *entries_N = diff + D + 1, *owner_E = entries_N + ctp.N, *held_E = owner_E + E;
    int64_t *sum_E = held_E + E, *or_E = sum_E + E;
    uint8_t *replicated_E = (uint8_t *)(or_E + E), *changed_E = replicated_E + E;
    const uint8_t *shard_ED = (const uint8_t *)bshard.buf, *mat_ED = (const uint8_t *)bmat.buf;
    uint8_t *mask_ED = (uint8_t *)bmask.buf;
    int64_t *copies_E = (int64_t *)bcopies.buf;

    /* Step 1: P ⊆ P', every expert's owner and holders, the replicas each device added (slots_D
     * counts them first) and the experts that have one. Eight devices per word; bytes only where a
     * word holds the owner or replicas. The shard is a shard placement (checked by the caller). */
    memset(slots_D, 0, (size_t)D * sizeof(int64_t));
    Py_ssize_t replicated = 0;
    for (Py_ssize_t e = 0; e < E; e++) {
        const uint8_t *s_D = shard_ED + (size_t)e * (size_t)D, *p_D = mat_ED + (size_t)e * (size_t)D;
        int64_t copies = 0, owner = 0;
        uint8_t rep = 0;
        Py_ssize_t d = 0;
        for (; d + 8 <= D; d += 8) {
            uint64_t sw, pw;
            memcpy(&sw, s_D + d, sizeof sw);
            memcpy(&pw, p_D + d, sizeof pw);
            if (sw & ~pw) {
                code = -2;
                goto done;
            }
            if (pw == 0) continue;
            copies += byte_sum(pw);
            if (sw)
                for (Py_ssize_t i = 0; i < 8; i++)
                    if (s_D[d + i]) owner = d + i;
            if (pw & ~sw) {
                rep = 1;
                for (Py_ssize_t i = 0; i < 8; i++) slots_D[d + i] += p_D[d + i] & !s_D[d + i];
            }
        }
        for (; d < D; d++) {
            if (s_D[d] && !p_D[d]) {
                code = -2;
                goto done;
            }
            copies += p_D[d];
            if (s_D[d]) owner = d;
            if (p_D[d] && !s_D[d]) {
                rep = 1;
                slots_D[d]++;
            }
        }
        copies_E[e] = held_E[e] = copies;
        owner_E[e] = owner;
        replicated_E[e] = rep;
        replicated += rep;
    }
    code = 0;
    const Py_ssize_t J = eligible_rows(slots_D, D, m, t, replicated, load_E, E, replicated_E, rep_J, fresh_J,
                                       experts_J);
    if (J < 0) {
        failed = 1;
        PyErr_NoMemory();
        goto done;
    }
    if (J == 0) goto done;                                              /* nothing to place */
    memcpy(mask_ED, mat_ED, (size_t)E * (size_t)D);
    if (!have_dev)
        fluid_device_load_pairs(&tp, mat_ED, load_E, E, held_E, owner_E, dev_load_D, s.holders_N, s.holders);
    place_replicas(&tp, mask_ED, load_E, experts_J, J, slots_D, copies_E, dev_load_D, NULL, &s);   /* l.8-11 */
    /* The rows that changed are among J's (placing a replica sets a byte of the expert's row). */
    int any_changed = 0;
    memset(changed_E, 0, (size_t)E);
    for (Py_ssize_t jj = 0; jj < J; jj++) {
        const int64_t e = experts_J[jj];
        changed_E[e] = copies_E[e] != held_E[e];
        any_changed |= changed_E[e];
    }
    if (!any_changed) goto done;                                    /* merged == materialized */

    /* Step 2: adopt only when the gain pays for the extra critical-path transfer. */
    if (ctp.D != tp.D) {
        code = -4;
        goto done;
    }
    extra_s = transfer_time(&ctp, mat_ED, mask_ED, E, changed_E, expert_bytes, intra_bw, inter_bw, before_D,
                            entries_N);
    if (extra_s > budget_s) goto done;
    /* The Alg. 3 device loads of both placements (cost.compute_time of their plans, exact integer
     * sums): experts calibration left alone add the same tokens to both; an expert with one holder
     * adds its row sum there. Row sums and signs first, in T's memory order. */
    const int64_t *tok = (const int64_t *)btok.buf;
    const Py_ssize_t se = btok.strides[0] / 8, sd = btok.strides[1] / 8;
    memset(sum_E, 0, (size_t)E * sizeof(int64_t));
    memset(or_E, 0, (size_t)E * sizeof(int64_t));
    if ((sd < 0 ? -sd : sd) < (se < 0 ? -se : se)) {
        for (Py_ssize_t e = 0; e < E; e++) {
            const int64_t *tok_e = tok + e * se;
            int64_t sum = 0, bits = 0;
            for (Py_ssize_t d = 0; d < D; d++) {
                sum += tok_e[d * sd];
                bits |= tok_e[d * sd];
            }
            sum_E[e] = sum;
            or_E[e] = bits;
        }
    } else {                                            /* column-major counts (the gate's T^T) */
        for (Py_ssize_t d = 0; d < D; d++) {
            const int64_t *tok_d = tok + d * sd;
            if (se == 1) {
                add_column(tok_d, E, sum_E, or_E);
            } else {
                for (Py_ssize_t e = 0; e < E; e++) {
                    sum_E[e] += tok_d[e * se];
                    or_E[e] |= tok_d[e * se];
                }
            }
        }
    }
    for (Py_ssize_t e = 0; e < E; e++)
        if (or_E[e] < 0) {                                   /* a negative count */
            code = -3;
            goto done;
        }
    holders_t h = {s.holders, s.cnt_N, s.taken_N};
    memset(before_D, 0, (size_t)D * sizeof(int64_t));
    memset(after_D, 0, (size_t)D * sizeof(int64_t));
    memset(delta_D, 0, (size_t)D * sizeof(int64_t));
    for (Py_ssize_t e = 0; e < E; e++) {
        if (or_E[e] == 0) continue;                          /* no tokens */
        int64_t *common_D = changed_E[e] ? delta_D : before_D;
        const uint8_t *p_D = mat_ED + (size_t)e * (size_t)D;
        const int64_t *tok_e = tok + e * se;
        if (held_E[e] == 1)
            common_D[owner_E[e]] += sum_E[e];
        else
            add_expert_load(&tp, e, p_D, tok_e, sd, &h, find_holders(&tp, p_D, &h), common_D, diff);
        if (changed_E[e]) {
            const uint8_t *q_D = mask_ED + (size_t)e * (size_t)D;
            add_expert_load(&tp, e, q_D, tok_e, sd, &h, find_holders(&tp, q_D, &h), after_D, diff);
        }
    }
    for (Py_ssize_t d = 0; d < D; d++) {    /* common + each placement's own part */
        after_D[d] += before_D[d];
        before_D[d] += delta_D[d];
    }
    before_s = (double)max_of(before_D, D) * time_per_token_s;
    after_s = (double)max_of(after_D, D) * time_per_token_s;
    code = before_s - after_s > extra_s && isfinite(extra_s) ? 1 : 0;
done:
    free(mem);
    free(converted_E);
    if (bdev.obj != NULL) PyBuffer_Release(&bdev);
    if (btok.obj != NULL) PyBuffer_Release(&btok);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bctopo);
    PyBuffer_Release(&bshard);
    PyBuffer_Release(&bmat);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bmask);
    PyBuffer_Release(&bcopies);
    if (failed || PyErr_Occurred()) return NULL;
    return Py_BuildValue("(lddd)", code, before_s, after_s, extra_s);
}

/* ------------------------------------------------------------------------------------ module */
/* ---------------------------------------------------------------------------- sparse per-rank path */
static int cmp_i64(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sort the n ids x (0 <= x < limit) ascending: insertion for a few, else an LSD radix sort by bytes
 * through tmp (n words; no comparison callback: placed replicas number up to m·D). */
static void sort_ids(int64_t *x, Py_ssize_t n, int64_t limit, int64_t *tmp)
{
    if (n <= 32) {
        for (Py_ssize_t i = 1; i < n; i++) {
            const int64_t v = x[i];
            Py_ssize_t pos = i;
            while (pos > 0 && x[pos - 1] > v) {
                x[pos] = x[pos - 1];
                pos--;
            }
            x[pos] = v;
        }
        return;
    }
    int64_t *src = x, *dst = tmp;
    for (int shift = 0; shift < 63 && (limit - 1) >> shift; shift += 8) {
        Py_ssize_t count[257] = {0};
        for (Py_ssize_t i = 0; i < n; i++) count[((src[i] >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (Py_ssize_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & 0xff]++] = src[i];
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != x) memcpy(x, src, (size_t)n * sizeof(int64_t));
}

/* materialize_pairs(topology, owners_E, load_E, t, m, full_J (w), pairs_X (w), copies_E (w)) -> (F, X), or
 * None for a load that is not finite and >= 0: Alg. 1 from the shard placement of owners_E without
 * building a mask, P' as the F experts every device holds (full_J, ascending; none when D = 1) and the
 * X other added replicas as e * D + d (pairs_X, ascending; room for D * min(m, t) of them when t > m);
 * copies_E gets P''s holder counts. Same decisions as `materialize`. */
static PyObject *py_materialize_pairs(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bown, bload, bpairs, bcopies;
    Py_ssize_t t, m;
    topo_t tp;
    scratch_t s;
    void *mem = NULL;
    uint8_t *row = NULL;
    long long rc = -2;
    Py_ssize_t F = 0, X = 0;
    (void)self;
    Py_buffer bfull;
    if (!PyArg_ParseTuple(args, "y*y*y*nnw*w*w*", &btopo, &bown, &bload, &t, &m, &bfull, &bpairs, &bcopies))
        return NULL;
    if (parse_topo(&btopo, &tp) < 0) goto done;
    const Py_ssize_t D = (Py_ssize_t)tp.D, N = (Py_ssize_t)tp.N, E = bload.len / (Py_ssize_t)sizeof(double);
    if (t < 0 || m < 0) {
        PyErr_SetString(PyExc_ValueError, "_cplan: t and m must be >= 0");
        goto done;
    }
    if (t > E) t = E;
    if (m > t) m = t;
    if (check_len(&bown, E, 8, "owners_E") < 0 || check_len(&bcopies, E, 8, "copies_E") < 0) goto done;
    if (bfull.len < (Py_ssize_t)sizeof(int64_t) * t || (t > m && bpairs.len < (Py_ssize_t)sizeof(int64_t) * m * D)) {
        PyErr_SetString(PyExc_ValueError, "_cplan: pairs_X is too small");
        goto done;
    }
    const double *load_E = (const double *)bload.buf;
    const int64_t *owners_E = (const int64_t *)bown.buf;
    for (Py_ssize_t e = 0; e < E; e++) {
        if (!(load_E[e] >= 0 && load_E[e] < INFINITY)) {
            rc = -1;
            goto done;
        }
        if (owners_E[e] < 0 || owners_E[e] >= D) {
            PyErr_SetString(PyExc_ValueError, "_cplan: an owner is out of range");
            goto done;
        }
    }
    int64_t *copies_E = (int64_t *)bcopies.buf, *pairs_X = (int64_t *)bpairs.buf, *full_J = (int64_t *)bfull.buf;
    for (Py_ssize_t e = 0; e < E; e++) copies_E[e] = 1;
    mem = alloc_scratch(&s, t, D, N, t + 2 * D + (t > m ? m * D : 0));
    row = (uint8_t *)calloc((size_t)(D > 0 ? D : 1), 1);
    if (mem == NULL || row == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *top_J = s.extra, *slots_D = top_J + t;
    double *dev_load_D = (double *)(slots_D + D);
    int64_t *tmp_X = (int64_t *)(dev_load_D + D);     /* the picks' sort */
    const Py_ssize_t J = top_experts(load_E, E, t, NULL, top_J);                    /* l.3 */
    if (J < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (J > 0 && m > 0 && D > 1) {
        if (t <= m) {                                                               /* l.4-5 */
            qsort(top_J, (size_t)J, sizeof(int64_t), cmp_i64);
            for (Py_ssize_t j = 0; j < J; j++) {
                full_J[F++] = top_J[j];
                copies_E[top_J[j]] = D;
            }
        } else {                                                                    /* l.7-11 */
            for (Py_ssize_t d = 0; d < D; d++) slots_D[d] = m;
            shard_device_load(owners_E, load_E, E, D, dev_load_D);
            s.row = row;
            s.pick_X = pairs_X;
            place_replicas(&tp, NULL, load_E, top_J, J, slots_D, copies_E, dev_load_D, owners_E, &s);
            sort_ids(pairs_X, s.npicks, (int64_t)E * D, tmp_X);               /* at most D * m of them */
            /* Experts that reached every device are full; the others' pairs stay, in order. */
            for (Py_ssize_t i = 0; i < s.npicks; i++) {
                const int64_t e = pairs_X[i] / (int64_t)D;
                if (copies_E[e] == D) {
                    if (F == 0 || full_J[F - 1] != e) full_J[F++] = e;
                } else {
                    pairs_X[X++] = pairs_X[i];
                }
            }
        }
    }
    rc = 0;
done:
    free(mem);
    free(row);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bown);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&bpairs);
    PyBuffer_Release(&bcopies);
    PyBuffer_Release(&bfull);
    if (rc == -2) return NULL;
    if (rc == -1) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", F, X);
}

/* own_row(topology, owners_E, full_J, pairs_X, tokens_E, rank, start_E (w), dest_Y (w), count_Y (w)) ->
 * entries, or -1 for inputs it declines: the rank's row R[e, rank, :] of Alg. 3 for P' = owners ∪
 * (full_J × D) ∪ pairs (full_J ascending; pairs_X ascending e * D + d, none at an owner or in a full
 * expert), as its entries with tokens: expert e's destinations (ascending) and counts are
 * [start_E[e], start_E[e + 1]) of dest_Y / count_Y. tokens_E[e] = T[e, rank], any stride. Same split
 * as split_row. O(E + X + the partly replicated experts' holders). */
static PyObject *py_own_row(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bown, bfull, bpairs, btok = {0}, bstart, bdest, bcount;
    PyObject *tok_obj;
    long long rank;
    topo_t tp;
    int64_t *holders = NULL;
    long long rc = -2;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*OLw*w*w*", &btopo, &bown, &bfull, &bpairs, &tok_obj, &rank, &bstart,
                          &bdest, &bcount))
        return NULL;
    if (parse_topo(&btopo, &tp) < 0) goto done;
    if (PyObject_GetBuffer(tok_obj, &btok, PyBUF_STRIDES) < 0) goto done;
    const Py_ssize_t D = (Py_ssize_t)tp.D, E = bown.len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t X = bpairs.len / (Py_ssize_t)sizeof(int64_t);
    if (btok.ndim != 1 || btok.itemsize != 8 || btok.shape[0] != E || btok.strides[0] % 8) {
        PyErr_SetString(PyExc_ValueError, "_cplan: tokens_E must be a 1-D int64 buffer of E counts");
        goto done;
    }
    if (rank < 0 || rank >= D) {
        PyErr_SetString(PyExc_ValueError, "_cplan: rank is out of range");
        goto done;
    }
    if (check_len(&bstart, E + 1, 8, "start_E") < 0 || bdest.len < (Py_ssize_t)sizeof(int64_t) * (E + X) ||
        bcount.len != bdest.len) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_cplan: dest_Y / count_Y too small");
        goto done;
    }
    const int64_t *owners_E = (const int64_t *)bown.buf, *pairs_X = (const int64_t *)bpairs.buf;
    const int64_t *full_J = (const int64_t *)bfull.buf;
    const Py_ssize_t F = bfull.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t f = 0;
    const Py_ssize_t st = btok.strides[0] / 8;
    const int64_t *tok = (const int64_t *)btok.buf;
    int64_t *start_E = (int64_t *)bstart.buf, *dest_Y = (int64_t *)bdest.buf, *count_Y = (int64_t *)bcount.buf;
    holders = (int64_t *)malloc((size_t)(D + 1) * sizeof(int64_t));
    if (holders == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t my_node = tp.node_D[rank], lo = tp.off_N[my_node], hi = tp.off_N[my_node + 1];
    Py_ssize_t x = 0, y = 0;
    for (Py_ssize_t e = 0; e < E; e++) {
        /* Up to the next expert with replicas, every expert has one holder, its owner: a tight loop.
         * (dest_Y / count_Y are written before y advances; a zero count is overwritten next.) */
        Py_ssize_t stop = f < F && full_J[f] < E ? (Py_ssize_t)full_J[f] : E;
        if (x < X && pairs_X[x] >= 0 && pairs_X[x] / D < stop) stop = (Py_ssize_t)(pairs_X[x] / D);
        int64_t bad = 0;
        for (; e < stop; e++) {
            const int64_t tokens = tok[e * st], owner = owners_E[e];
            bad |= tokens | owner | (D - 1 - owner);
            start_E[e] = y;
            dest_Y[y] = owner;
            count_Y[y] = tokens;
            y += tokens != 0;
        }
        if (bad < 0) {                                   /* a negative count, or an owner out of range */
            rc = -1;
            goto done;
        }
        if (e >= E) break;
        const int64_t tokens = tok[e * st], owner = owners_E[e];
        if (tokens < 0 || owner < 0 || owner >= D) {
            rc = -1;
            goto done;
        }
        start_E[e] = y;
        if (f < F && full_J[f] == e) {                   /* on every device: the rank keeps its tokens */
            f++;
            if (x < X && pairs_X[x] < (int64_t)(e + 1) * D) {
                rc = -1;
                goto done;
            }
            if (tokens) {
                dest_Y[y] = rank;
                count_Y[y++] = tokens;
            }
            continue;
        }
        if (f < F && full_J[f] < e) {                    /* unsorted or out of range */
            rc = -1;
            goto done;
        }
        /* e's holders, ascending: its replicas (pairs of row e) with the owner merged in. */
        Py_ssize_t c = 0;
        int owner_in = 0;
        const int64_t row0 = (int64_t)e * D;
        while (x < X && pairs_X[x] < row0 + D) {
            const int64_t d = pairs_X[x++] - row0;
            if (d < 0 || d == owner || (c > 0 && d <= holders[c - 1])) {   /* unsorted, or at the owner */
                rc = -1;
                goto done;
            }
            if (!owner_in && owner < d) {
                holders[c++] = owner;
                owner_in = 1;
            }
            holders[c++] = d;
        }
        if (!owner_in) holders[c++] = owner;
        if (tokens == 0) continue;
        if (c == 1) {                                    /* every token goes to the one holder */
            dest_Y[y] = owner;
            count_Y[y++] = tokens;
            continue;
        }
        /* l.4-5: a holder keeps its tokens; l.9-10: else the holders on its node; l.12: else all. */
        Py_ssize_t first = 0, k = 0, held = 0;
        for (Py_ssize_t h = 0; h < c; h++) {
            if (holders[h] == rank) held = 1;
            if (holders[h] >= lo && holders[h] < hi) {
                if (k == 0) first = h;
                k++;
            }
        }
        if (held) {
            dest_Y[y] = rank;
            count_Y[y++] = tokens;
            continue;
        }
        const int64_t *targets = k > 0 ? holders + first : holders;
        if (k == 0) k = c;
        const int64_t q = tokens / k, r = tokens % k, offset = ((int64_t)e + rank) % k;
        for (int64_t j = 0; j < k; j++) {
            int64_t u = j - offset;
            if (u < 0) u += k;
            const int64_t n = q + (u < r);
            if (n) {
                dest_Y[y] = targets[j];
                count_Y[y++] = n;
            }
        }
    }
    if (x != X || f != F) {                              /* pairs or full experts beyond the last expert */
        rc = -1;
        goto done;
    }
    start_E[E] = y;
    rc = y;
done:
    free(holders);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bown);
    PyBuffer_Release(&bfull);
    PyBuffer_Release(&bpairs);
    if (btok.obj != NULL) PyBuffer_Release(&btok);
    PyBuffer_Release(&bstart);
    PyBuffer_Release(&bdest);
    PyBuffer_Release(&bcount);
    if (rc == -2) return NULL;
    return PyLong_FromLongLong(rc);
}

/* ------------------------------------------------------------------------------ calibration from pairs */
/* cost.fluid_device_load of the placement of the X ascending pairs flat_X (e * D + d) on tp, bit for bit:
 * on one node the even split load_e / c_e, else a holder d of e on node n adds
 * load_e / D · (k_n / h_en + U_e / c_e) (U_e devices on nodes without e: small integers, exact), both
 * as numpy's weighted bincount over the pairs adds them (in pair order, from 0.0). copies_E: the holder
 * counts; run_D: [D] scratch. */
static void fluid_load_of_pairs(const topo_t *tp, const int64_t *flat_X, Py_ssize_t X, const int64_t *copies_E,
                                const double *load_E, double *out_D, int64_t *run_D)
{
    const int64_t D = tp->D;
    int64_t e = 0, row0 = 0;           /* the expert of the current pair, and e * D (no division) */
    for (int64_t d = 0; d < D; d++) out_D[d] = 0.0;
    if (tp->N == 1) {
        for (Py_ssize_t x = 0; x < X; x++) {
            for (; flat_X[x] >= row0 + D; row0 += D) e++;
            out_D[flat_X[x] - row0] += load_E[e] / (double)copies_E[e];
        }
        return;
    }
    for (Py_ssize_t a = 0; a < X;) {                       /* expert e's pairs are flat_X[a, b) */
        for (; flat_X[a] >= row0 + D; row0 += D) e++;
        Py_ssize_t b = a + 1;
        while (b < X && flat_X[b] < row0 + D) b++;
        if (b == a + 1) {         /* one holder: k_n / 1 + (D - k_n) / 1 is D exactly (small integers) */
            out_D[flat_X[a] - row0] += (load_E[e] / (double)D) * (double)D;
            a = b;
            continue;
        }
        int64_t covered = 0;
        for (Py_ssize_t i = a; i < b;) {                   /* a node's holders are a run of the pairs */
            const int64_t nn = tp->node_D[flat_X[i] - row0];
            Py_ssize_t j = i + 1;
            while (j < b && tp->node_D[flat_X[j] - row0] == nn) j++;
            for (Py_ssize_t q = i; q < j; q++) run_D[q - a] = (int64_t)(j - i);
            covered += tp->k_N[nn];
            i = j;
        }
        const double spread = (double)(D - covered) / (double)copies_E[e], per_device = load_E[e] / (double)D;
        for (Py_ssize_t i = a; i < b; i++) {
            const int64_t d = flat_X[i] - row0;
            out_D[d] += per_device * ((double)tp->k_N[tp->node_D[d]] / (double)run_D[i - a] + spread);
        }
        a = b;
    }
}

static double max_double(const double *x_D, Py_ssize_t D)
{
    double best = x_D[0];
    for (Py_ssize_t d = 1; d < D; d++)
        if (x_D[d] > best) best = x_D[d];
    return best;
}

/* calibrate_pairs(topology, cost_topology, owners_E, flat_P, load_E, t, m, expert_bytes, intra_bw,
 *                 inter_bw, budget_s, time_per_token_s, added_X (w), copies_E (w))
 *     -> (code, added, before_s, after_s, extra_s)
 *
 * materialize._calibrate_pairs: calibration (§4.2) with the fluid compute model from the pairs, in one
 * call, never an [E, D] matrix. owners_E: the shard placement P; flat_P: P' as ascending flat ids
 * e * D + d; load_E: float64 actual loads; t, m: >= 0 (capped here as calibrate caps them); the cost's
 * Ψ, its topology's bandwidths, budget and time per token. Step 1 re-runs l.8-11 on the rows of the
 * J <= t experts calibration may extend (those P' replicates, and the highest-load others the remaining
 * overlap degree allows) with the remaining slots; step 2 weighs the merged placement with the float
 * operations of the numpy code: the transfer of the new pairs on the cost's topology (`bottleneck_time`
 * of the chunks each device receives and of the nodes an expert newly reaches), the budget, and
 * `straggler_time` of both placements' fluid loads on the cost's topology.
 * added_X: room for min(m, t)·D ids; copies_E: [E]. code 1: adopt the merged placement P' ∪ the
 * `added` new pairs, ascending in added_X, its holder counts in copies_E; 0: keep P'; negative where the
 * numpy code must judge (and raise its precise ValueError): -1 a load is negative, NaN or infinite;
 * -2 P ⊄ P'; -4 buffers or topologies do not match. The times are those compared (0.0 where not
 * reached). */
static PyObject *py_calibrate_pairs(PyObject *self, PyObject *args)
{
    Py_buffer btopo, bctopo, bown, bflat, bload, badded, bcopies;
    Py_ssize_t t, m;
    double expert_bytes, intra_bw, inter_bw, budget_s, time_per_token_s;
    double before_s = 0.0, after_s = 0.0, extra_s = 0.0;
    topo_t tp, ctp;
    scratch_t s;
    void *mem = NULL, *work = NULL;
    long code = -4;
    int failed = 1;
    Py_ssize_t added = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*nndddddw*w*", &btopo, &bctopo, &bown, &bflat, &bload, &t, &m,
                          &expert_bytes, &intra_bw, &inter_bw, &budget_s, &time_per_token_s, &badded, &bcopies))
        return NULL;
    if (parse_topo(&btopo, &tp) < 0 || parse_topo(&bctopo, &ctp) < 0) goto done;
    failed = 0;
    const Py_ssize_t D = (Py_ssize_t)tp.D, N = (Py_ssize_t)tp.N, E = bload.len / 8, X = bflat.len / 8;
    if (t < 0 || m < 0) goto done;                                                  /* code -4 */
    if (t > E) t = E;
    if (m > t) m = t;
    if (bown.len != E * 8 || bcopies.len != E * 8 || badded.len < m * D * 8 || ctp.D != tp.D ||
        !(intra_bw > 0) || !(inter_bw > 0))
        goto done;
    const double *load_E = (const double *)bload.buf;
    const int64_t *owners_E = (const int64_t *)bown.buf, *flat_P = (const int64_t *)bflat.buf;
    for (Py_ssize_t e = 0; e < E; e++) {             /* check_loads' fast accept: finite and >= 0 */
        if (!(load_E[e] >= 0 && load_E[e] < INFINITY)) {
            code = -1;
            goto done;
        }
        if (owners_E[e] < 0 || owners_E[e] >= D) goto done;
    }
    /* Work memory: per expert its row in J (or -1) and two flags (bytes); per device the free slots,
     * the chunks it receives and a scratch run length; as many words as the new pairs (m·D at most)
     * to sort them; the merged pairs; four load vectors [D]; the cost topology's node stamps and entries; J's
     * lists (3t) and the rows' loads, holder counts and ids 0 .. J - 1 as place_replicas reads them
     * (3t); J's rows, a byte per device. */
    const size_t words = (size_t)E + (size_t)D * (3 + 2 * (size_t)m + 4) + (size_t)X + 2 * (size_t)ctp.N +
                         6 * (size_t)t + 1;
    work = malloc(words * sizeof(int64_t) + 2 * (size_t)E + (size_t)t * (size_t)D + 1);
    mem = alloc_scratch(&s, t, D, N, 0);
    if (work == NULL || mem == NULL) {
        failed = 1;
        PyErr_NoMemory();
        goto done;
    }
    int64_t *row_E = (int64_t *)work, *slots_D = row_E + E, *recv_D = slots_D + D, *run_D = recv_D + D;
    int64_t *tmp_X = run_D + D, *merged_X = tmp_X + m * D;
    double *before_D = (double *)(merged_X + X + m * D), *dev_load_D = before_D + D, *after_D = dev_load_D + D;
    double *cbefore_D = after_D + D;
    int64_t *stamp_N = (int64_t *)(cbefore_D + D), *entries_N = stamp_N + ctp.N, *rep_J = entries_N + ctp.N;
    int64_t *fresh_J = rep_J + t, *experts_J = fresh_J + t, *copies_J = experts_J + t, *ids_J = copies_J + t;
    double *load_J = (double *)(ids_J + t);
    uint8_t *replicated_E = (uint8_t *)(load_J + t + 1), *held_E = replicated_E + E, *mask_JD = held_E + E;
    int64_t *copies_E = (int64_t *)bcopies.buf, *new_X = (int64_t *)badded.buf;

    /* Step 1: P ⊆ P' (every owner's pair present), P''s holder counts, the replicas each device added
     * (slots_D counts them first) and the experts that have one. */
    memset(slots_D, 0, (size_t)D * sizeof(int64_t));
    memset(copies_E, 0, (size_t)E * sizeof(int64_t));
    memset(replicated_E, 0, 2 * (size_t)E);
    int64_t prev = -1, e = 0, row0 = 0;                 /* pair x's expert and e * D (no division) */
    for (Py_ssize_t x = 0; x < X; x++) {
        const int64_t id = flat_P[x];
        if (id <= prev || id >= (int64_t)E * D) goto done;                         /* code -4 */
        prev = id;
        for (; id >= row0 + D; row0 += D) e++;
        const int64_t d = id - row0;
        copies_E[e]++;
        if (d == owners_E[e]) {
            held_E[e] = 1;
        } else {
            replicated_E[e] = 1;
            slots_D[d]++;
        }
    }
    Py_ssize_t replicated = 0;
    for (Py_ssize_t e = 0; e < E; e++) {
        if (!held_E[e]) {
            code = -2;
            goto done;
        }
        replicated += replicated_E[e];
    }
    code = 0;
    const Py_ssize_t J = eligible_rows(slots_D, D, m, t, replicated, load_E, E, replicated_E, rep_J, fresh_J,
                                       experts_J);
    if (J < 0) {
        failed = 1;
        PyErr_NoMemory();
        goto done;
    }
    if (J == 0) goto done;                                              /* nothing to place */
    /* l.8-11 on J's rows alone: row j is expert experts_J[j], with its load, holder count and id j in
     * load_J, copies_J, ids_J. P''s holders are marked 2, so that the replicas placed (1) stand apart. */
    for (Py_ssize_t e = 0; e < E; e++) row_E[e] = -1;
    for (Py_ssize_t jj = 0; jj < J; jj++) {
        row_E[experts_J[jj]] = jj;
        load_J[jj] = load_E[experts_J[jj]];
        copies_J[jj] = copies_E[experts_J[jj]];
        ids_J[jj] = jj;
    }
    memset(mask_JD, 0, (size_t)J * (size_t)D);
    e = 0;
    row0 = 0;
    for (Py_ssize_t x = 0; x < X; x++) {
        for (; flat_P[x] >= row0 + D; row0 += D) e++;
        if (row_E[e] >= 0) mask_JD[row_E[e] * D + (flat_P[x] - row0)] = 2;
    }
    fluid_load_of_pairs(&tp, flat_P, X, copies_E, load_E, before_D, run_D);
    memcpy(dev_load_D, before_D, (size_t)D * sizeof(double));
    place_replicas(&tp, mask_JD, load_J, ids_J, J, slots_D, copies_J, dev_load_D, NULL, &s);     /* l.8-11 */
    /* The new pairs (bytes 1 of the rows whose holder count grew), the chunks each device receives
     * and the (expert, node) entries of the cost topology's nodes that an expert newly reaches. */
    memset(recv_D, 0, (size_t)D * sizeof(int64_t));
    memset(entries_N, 0, (size_t)ctp.N * sizeof(int64_t));
    for (Py_ssize_t nn = 0; nn < ctp.N; nn++) stamp_N[nn] = -1;
    for (Py_ssize_t jj = 0; jj < J; jj++) {
        const int64_t e = experts_J[jj];
        if (copies_J[jj] == copies_E[e]) continue;
        const uint8_t *row_D = mask_JD + jj * D;
        const Py_ssize_t holders = row_holders(row_D, D, s.holders);     /* P''s (2) and new (1) */
        for (Py_ssize_t h = 0; h < holders; h++)
            if (row_D[s.holders[h]] == 2) stamp_N[ctp.node_D[s.holders[h]]] = 2 * jj;
        for (Py_ssize_t h = 0; h < holders; h++) {
            const int64_t d = s.holders[h];
            if (row_D[d] != 1) continue;
            new_X[added++] = e * (int64_t)D + d;
            recv_D[d]++;
            const int64_t nn = ctp.node_D[d];
            if (stamp_N[nn] != 2 * jj && stamp_N[nn] != 2 * jj + 1) {
                entries_N[nn]++;
                stamp_N[nn] = 2 * jj + 1;
            }
        }
        copies_E[e] = copies_J[jj];         /* the merged placement's holder count */
    }
    if (added == 0) goto done;                                      /* merged == P' */
    /* Step 2: adopt only when the gain pays for the extra critical-path transfer. */
    int64_t max_recv = 0, max_entries = 0;
    for (Py_ssize_t d = 0; d < D; d++)
        if (recv_D[d] > max_recv) max_recv = recv_D[d];
    for (Py_ssize_t nn = 0; nn < ctp.N; nn++)
        if (entries_N[nn] > max_entries) max_entries = entries_N[nn];
    const double device_s = (double)max_recv * expert_bytes / intra_bw;
    const double node_s = (double)max_entries * expert_bytes / inter_bw;
    extra_s = node_s > device_s ? node_s : device_s;
    if (extra_s > budget_s) goto done;
    /* P' ∪ new pairs, ascending (the new pairs are few: sorted, then merged in). */
    sort_ids(new_X, added, (int64_t)E * D, tmp_X);
    Py_ssize_t a = 0, b = 0, pairs = 0;
    while (a < X || b < added)
        merged_X[pairs++] = b >= added || (a < X && flat_P[a] < new_X[b]) ? flat_P[a++] : new_X[b++];
    /* Straggler times of the fluid loads on the cost's topology (the loads of step 1 where it is the
     * same layout). P''s holder counts for the first: copies_E less the new pairs. */
    const int same = btopo.len == bctopo.len && memcmp(btopo.buf, bctopo.buf, (size_t)btopo.len) == 0;
    const double *b_D = before_D;
    if (!same) {
        for (Py_ssize_t x = 0; x < added; x++) copies_E[new_X[x] / D]--;
        fluid_load_of_pairs(&ctp, flat_P, X, copies_E, load_E, cbefore_D, run_D);
        for (Py_ssize_t x = 0; x < added; x++) copies_E[new_X[x] / D]++;
        b_D = cbefore_D;
    }
    fluid_load_of_pairs(&ctp, merged_X, pairs, copies_E, load_E, after_D, run_D);
    before_s = max_double(b_D, D) * time_per_token_s;
    after_s = max_double(after_D, D) * time_per_token_s;
    code = before_s - after_s > extra_s && isfinite(extra_s) ? 1 : 0;
done:
    free(mem);
    free(work);
    PyBuffer_Release(&btopo);
    PyBuffer_Release(&bctopo);
    PyBuffer_Release(&bown);
    PyBuffer_Release(&bflat);
    PyBuffer_Release(&bload);
    PyBuffer_Release(&badded);
    PyBuffer_Release(&bcopies);
    if (failed || PyErr_Occurred()) return NULL;
    return Py_BuildValue("(lnddd)", code, added, before_s, after_s, extra_s);
}

static PyMethodDef cplan_methods[] = {
    {"materialize", py_materialize, METH_VARARGS, "Alg. 1 core (sparse_materialization after validation)."},
    {"place_replicas", py_place_replicas, METH_VARARGS, "Alg. 1 l.7-11 in place (_place_replicas)."},
    {"assign_slots", py_assign_slots, METH_VARARGS, "Alg. 1 l.9 (_assign_slots_by_load), for tests."},
    {"fluid_device_load", py_fluid_device_load, METH_VARARGS, "cost.fluid_device_load's pair sum, for tests."},
    {"calibrate", py_calibrate, METH_VARARGS, "Calibration (§4.2) with the Alg. 3 compute model."},
    {"dispatch", py_dispatch, METH_VARARGS, "Alg. 3: the full plan R[e, d, d2]."},
    {"dispatch_rows", py_dispatch_rows, METH_VARARGS, "Alg. 3: rows R[:, sources, :]."},
    {"dispatch_device_load", py_dispatch_device_load, METH_VARARGS, "Alg. 3: tokens per device."},
    {"materialize_pairs", py_materialize_pairs, METH_VARARGS, "Alg. 1 from owners, P' \\ P as pairs."},
    {"own_row", py_own_row, METH_VARARGS, "Alg. 3: one rank's row, sparse, from owners and pairs."},
    {"calibrate_pairs", py_calibrate_pairs, METH_VARARGS, "Calibration (§4.2), fluid model, from the pairs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cplan_module = {
    PyModuleDef_HEAD_INIT, "_cplan", "Compiled core of the planner hot path (Alg. 1 and Alg. 3).", -1,
    cplan_methods, NULL, NULL, NULL, NULL,
};

/* Bumped whenever an entry point's arguments change: the Python side ignores a stale build. */
#define CPLAN_ABI 4

PyMODINIT_FUNC PyInit__cplan(void)
{
    PyObject *module = PyModule_Create(&cplan_module);
    if (module != NULL && PyModule_AddIntConstant(module, "ABI", CPLAN_ABI) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
