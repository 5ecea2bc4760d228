/* Decodes raw blocks of one weight type with run.c's scalar to_float (the
   reference every other kernel set is tested against), for
   tests/test_run_dequant.py to compare with the gguf package's decoder.
   Usage: dequant_driver TYPE_ID IN OUT; IN holds whole blocks, OUT gets
   the floats; stdout gets the type's row of the table: name, elements
   and bytes per block. Includes run.c whole so the static kernels are
   reachable. */
#define main run_main
#include "../run.c"
#undef main

int main(int argc, char **argv)
{
    if (argc != 4) die(EXIT_USAGE, "usage: dequant_driver TYPE_ID IN OUT");
    int type = atoi(argv[1]);
    if (!type_name(type)) die(EXIT_USAGE, "type %d is not in the table", type);
    const WeightType *t = &TYPES[type];
    FILE *f = fopen(argv[2], "rb");
    if (!f) die(EXIT_RUNTIME, "cannot open %s", argv[2]);
    size_t cap = 1 << 20, got = 0, r;
    uint8_t *in = xmalloc(cap);
    while ((r = fread(in + got, 1, cap - got, f)) > 0)
        if ((got += r) == cap) in = realloc(in, cap *= 2);
    fclose(f);
    if (!in || got % t->block_bytes) die(EXIT_RUNTIME, "%zu bytes is not a whole number of %s blocks", got, t->name);
    int n = (int)(got / t->block_bytes * t->block);
    float *out = xmalloc(n * sizeof(float));
    t->k[KSET_SCALAR].to_float(out, in, n);
    FILE *o = fopen(argv[3], "wb");
    if (!o || fwrite(out, sizeof(float), n, o) != (size_t)n || fclose(o)) die(EXIT_RUNTIME, "cannot write %s", argv[3]);
    printf("%s %d %zu\n", t->name, t->block, t->block_bytes);
    free(in);
    free(out);
    return 0;
}
