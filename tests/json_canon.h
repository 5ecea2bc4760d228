/* The canonical text of a parsed JSON tree, for the JSON reader's tests
   (tests/json_driver.c, tests/fuzz/fuzz_json.c): no whitespace, members in
   document order, strings through json_put_string, numbers through
   json_put_number. Include after run.c. */

static void json_put_value(Buf *b, const Json *v)
{
    switch (v->kind) {
    case JSON_NULL: buf_put(b, "null", 4); return;
    case JSON_BOOL: v->boolean ? buf_put(b, "true", 4) : buf_put(b, "false", 5); return;
    case JSON_NUMBER: json_put_number(b, v->number); return;
    case JSON_STRING: json_put_string(b, v->str, v->len); return;
    case JSON_ARRAY:
    case JSON_OBJECT:
        buf_put(b, v->kind == JSON_ARRAY ? "[" : "{", 1);
        for (int i = 0; i < v->n; i++) {
            if (i) buf_put(b, ",", 1);
            if (v->kind == JSON_OBJECT) { json_put_string(b, v->keys[i], v->key_lens[i]); buf_put(b, ":", 1); }
            json_put_value(b, &v->items[i]);
        }
        buf_put(b, v->kind == JSON_ARRAY ? "]" : "}", 1);
    }
}
