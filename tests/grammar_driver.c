/* Classifies byte strings with run.c's JSON automaton (the --json and
   --json-schema recognizer), for tests/test_json_output.py to compare with
   an independent reference and with Python's json and jsonschema.
   Usage: grammar_driver [SCHEMA_FILE] < lines; each line of stdin is one
   byte string in hex (an empty line: the empty string), and gets one line
   on stdout: "invalid" (no value the grammar allows begins so),
   "prefix" (some do, and it is not one yet) or "complete" (it is one: a
   top-level number may still go on). Includes run.c whole so the static
   automaton is reachable. */
#define main run_main
#include "../run.c"
#undef main

static const char *classify(const JsonGrammar *g, int root, const unsigned char *p, size_t n)
{
    JsonState s;
    json_start(&s, root);
    if (!json_feed_all(g, &s, (const char *)p, n)) return "invalid";
    return json_complete(g, &s) ? "complete" : "prefix";
}

int main(int argc, char **argv)
{
    if (argc > 2) die(EXIT_USAGE, "usage: grammar_driver [SCHEMA_FILE] < hex lines");
    JsonGrammar g;
    json_grammar_init(&g);
    int root = argc == 2 ? compile_schema_file(&g, argv[1]) : 0;
    char line[1 << 16];
    unsigned char bytes[1 << 15];
    while (fgets(line, sizeof line, stdin)) {
        size_t len = strcspn(line, "\r\n"), n = 0;
        if (len % 2) die(EXIT_USAGE, "odd hex line");
        for (size_t i = 0; i < len; i += 2) {
            int hi = json_hex_value((unsigned char)line[i]), lo = json_hex_value((unsigned char)line[i + 1]);
            if (hi < 0 || lo < 0) die(EXIT_USAGE, "not hex: %s", line);
            bytes[n++] = (unsigned char)(hi << 4 | lo);
        }
        puts(classify(&g, root, bytes, n));
    }
    json_grammar_free(&g);
    return 0;
}
