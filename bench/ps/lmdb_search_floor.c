/* LMDB's own lookup rate, with no Python: the ceiling of any file:// read path that goes
 * through LMDB's API (bench/RESULTS.md, "Issue 15").
 *
 * Reads every key of KEYS (little-endian int64, as numpy's tofile writes them) from the
 * named database of the psclient store at DIR (key bytes as psclient writes them: 8
 * big-endian bytes of key ^ 2**63), in one read transaction per thread, copying each row
 * out; prints the best of 30 passes in rows/s.
 *
 *   apt-get install liblmdb-dev
 *   cc -O2 -pthread -o /tmp/lmdb_search_floor bench/ps/lmdb_search_floor.c -llmdb
 *   /tmp/lmdb_search_floor DIR rows:TABLE KEYS [THREADS]
 */
#include <lmdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static MDB_env *env;
static MDB_dbi dbi;
static unsigned char (*kb)[8];
static size_t nkeys, row_cap = 1 << 16;

typedef struct { size_t a, b, found; unsigned check; } Range;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *work(void *arg) {
    Range *r = arg;
    MDB_txn *txn;
    char *row = malloc(row_cap); /* NOTE: each row is copied out, as a lookup does */
    r->found = 0;
    r->check = 0;
    if (mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)) { free(row); return NULL; }
    for (size_t i = r->a; i < r->b; i++) {
        MDB_val key = {8, kb[i]}, val;
        if (mdb_get(txn, dbi, &key, &val) == 0) {
            size_t n = val.mv_size < row_cap ? val.mv_size : row_cap;
            memcpy(row, val.mv_data, n);
            r->check += (unsigned char)row[n ? n - 1 : 0]; /* NOTE: the copy is used */
            r->found++;
        }
    }
    mdb_txn_abort(txn);
    free(row);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s DIR DBNAME KEYS [THREADS]\n", argv[0]);
        return 2;
    }
    int threads = argc > 4 ? atoi(argv[4]) : 1;
    if (threads < 1 || threads > 64) threads = 1;
    FILE *f = fopen(argv[3], "rb");
    if (!f) { perror(argv[3]); return 1; }
    fseek(f, 0, SEEK_END);
    nkeys = (size_t)ftell(f) / 8;
    fseek(f, 0, SEEK_SET);
    int64_t *keys = malloc(nkeys * 8);
    kb = malloc(nkeys * 8);
    if (fread(keys, 8, nkeys, f) != nkeys) { fprintf(stderr, "short read\n"); return 1; }
    fclose(f);
    for (size_t i = 0; i < nkeys; i++) {
        uint64_t u = (uint64_t)keys[i] ^ (1ULL << 63);
        for (int j = 0; j < 8; j++) kb[i][j] = (unsigned char)(u >> (56 - 8 * j));
    }
    int rc;
    mdb_env_create(&env);
    mdb_env_set_maxdbs(env, 128);
    if ((rc = mdb_env_open(env, argv[1], MDB_RDONLY | MDB_NORDAHEAD, 0644))) {
        fprintf(stderr, "%s: %s\n", argv[1], mdb_strerror(rc));
        return 1;
    }
    MDB_txn *txn;
    mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if ((rc = mdb_dbi_open(txn, argv[2], 0, &dbi))) {
        fprintf(stderr, "%s: %s\n", argv[2], mdb_strerror(rc));
        return 1;
    }
    mdb_txn_commit(txn); /* NOTE: commit, not abort: an aborted txn closes the dbi */
    double best = 1e9;
    size_t found = 0;
    unsigned check = 0;
    for (int pass = 0; pass < 30; pass++) {
        pthread_t th[64];
        Range rr[64];
        double t = now();
        for (int i = 0; i < threads; i++) {
            rr[i].a = nkeys * i / threads;
            rr[i].b = nkeys * (i + 1) / threads;
            pthread_create(&th[i], NULL, work, &rr[i]);
        }
        found = 0;
        check = 0;
        for (int i = 0; i < threads; i++) {
            pthread_join(th[i], NULL);
            found += rr[i].found;
            check += rr[i].check;
        }
        t = now() - t;
        if (t < best) best = t;
    }
    printf("{\"keys\": %zu, \"found\": %zu, \"threads\": %d, \"rows_per_s\": %.0f, "
           "\"check\": %u}\n", nkeys, found, threads, nkeys / best, check);
    return 0;
}
