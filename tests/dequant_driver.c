/* Decodes raw blocks of one weight type with run.c's scalar to_float (the
   reference every other kernel set is tested against), for
   tests/test_run_dequant.py to compare with the gguf package's decoder.
   Usage: dequant_driver TYPE_ID IN OUT; IN holds whole blocks, OUT gets
   the floats; stdout gets the type's row of the table: name, elements
   and bytes per block. With a fourth argument "from", the other way: IN
   holds floats, OUT gets them quantized by the scalar from_float (the KV
   cache's types). Includes run.c whole so the static kernels are
   reachable. */
#define main run_main
#include "../run.c"
#undef main

int main(int argc, char **argv)
{
    if (argc != 4 && argc != 5) die(EXIT_USAGE, "usage: dequant_driver TYPE_ID IN OUT [from]");
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
    int from = argc == 5;
    size_t unit = from ? t->block * sizeof(float) : t->block_bytes;
    if (!in || got % unit) die(EXIT_RUNTIME, "%zu bytes is not a whole number of %s blocks", got, t->name);
    if (from && !SET_SCALAR.type[type].from_float) die(EXIT_USAGE, "%s has no from_float", t->name);
    int n = (int)(got / unit * t->block);
    size_t out_bytes = from ? row_bytes(type, n) : n * sizeof(float);
    void *out = xmalloc(out_bytes);
    if (from) SET_SCALAR.type[type].from_float(out, (const float *)in, n);
    else SET_SCALAR.type[type].to_float(out, in, n);
    FILE *o = fopen(argv[3], "wb");
    if (!o || fwrite(out, 1, out_bytes, o) != out_bytes || fclose(o)) die(EXIT_RUNTIME, "cannot write %s", argv[3]);
    printf("%s %d %zu\n", t->name, t->block, t->block_bytes);
    free(in);
    free(out);
    return 0;
}
