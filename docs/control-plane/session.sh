#!/usr/bin/env bash
# Captures the session of docs/control-plane.md ("A session") against a real orbitkv-cache-manager and
# prints it as the markdown that goes between the doc's session markers (needs curl, jq, the package
# installed, ports 9091-9092 free). Usage: docs/control-plane/session.sh > session.md; WORK=dir keeps the
# scratch files (register.json, the manager's log) there.
set -u
WORK=${WORK:-$(mktemp -d)}
cd "$WORK"
echo "scratch files in $WORK" >&2
rm -f /tmp/ssd0.bin
export ORBITKV_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
orbitkv-cache-manager --pool-size 64mb --ssd-cache-path /tmp/ssd0.bin --ssd-cache-capacity 256mb \
  --log-level warning > manager.log 2>&1 &
MGR=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:9091/healthz >/dev/null && break; sleep 0.5; done
AUTH="Authorization: Bearer $ORBITKV_ADMIN_TOKEN"
exec 3>&2 4>&1 > transcript.md 2>&1
open=0
# A console block per run of commands, a blank line between commands; a command's stdout and stderr
# interleaved as a terminal shows them; the output of one that prints no final newline (curl) is ended by
# run's own.
run() { if [ $open = 1 ]; then printf '\n'; else printf '```console\n'; open=1; fi
        printf '$ %s\n' "$1"; eval "$1" > out.txt 2>&1; cat out.txt; [ -z "$(tail -c 1 out.txt)" ] || printf '\n'; }
text() { [ $open = 0 ] || { printf '```\n\n'; open=0; }; printf '%s\n\n' "$1"; }

text '```console
$ export ORBITKV_ADMIN_TOKEN=$(python3 -c '"'"'import secrets; print(secrets.token_urlsafe(24))'"'"')
$ orbitkv-cache-manager --pool-size 64mb --ssd-cache-path /tmp/ssd0.bin --ssd-cache-capacity 256mb --log-level warning &
$ AUTH="Authorization: Bearer $ORBITKV_ADMIN_TOKEN"
```'
text '### Health, readiness, configuration'
run 'curl -s http://127.0.0.1:9091/healthz'
run 'curl -s http://127.0.0.1:9091/readyz'
run 'curl -s http://127.0.0.1:9091/v1/config | jq .'

text '### Register an engine'
text 'An engine keeps its KV pages in memory the manager can map: here a host pages file in the manager'"'"'s
`--shm-dir` (on a GPU, CUDA IPC handles). `orbitkv-sample-engine pages` makes one (4 layers, K and V
tensors, BF16, random values) and prints the registration body a connector sends:'
run 'orbitkv-sample-engine pages --codec fp8 > register.json'
run "jq '{model, engine_id, codec, tensors: (.tensors | length), first_tensor: .tensors[0]}' register.json"
run 'curl -s -i -X POST http://127.0.0.1:9091/v1/engines -H "Content-Type: application/json" -d @register.json'
text 'Registration errors name the field; nothing is registered:'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/engines -w "\n%{http_code}\n"'
run "jq '.tensors[0].handle = {\"type\": \"host\", \"path\": \"/etc/passwd\", \"offset\": 0}' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.tensors[1].handle.name = \"no-such-object\"' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.tensors[0].shape[2] = 3' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.block_size = \"16\" | .turbo = true' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
text 'A valid registration over REST (a second engine, `rest-tp0`, with its own pages). Its answer alone
carries the engine'"'"'s `credential` (shortened here, kept in `rest-registered.json`), which every data-plane
call for the engine must present (`client.set_credential`); a call without it is refused:'
run 'orbitkv-sample-engine pages --engine-id rest-tp0 > rest.json'
# The answer's credential is the engine's secret: kept, shown shortened.
run 'curl -s -X POST http://127.0.0.1:9091/v1/engines -H "$AUTH" -H "Content-Type: application/json" -d @rest.json -w "\n%{http_code}\n" | tee rest-registered.json | jq -c "if type == \"object\" then .credential |= .[:8] + \"...\" else . end"'
run 'orbitkv-sample-engine save --engine-id rest-tp0; echo "exit status $?"'
text 'The sample engine registers itself over the data plane (the client API: `connect`, `register`, which
answers the credential; the engine keeps it next to its pages for its later commands) and saves four chunks
of two blocks (`save`); then the same id again, or another id over its pages:'
run 'orbitkv-sample-engine save --codec fp8'
SAMPLE_CREDENTIAL=$(head -1 /dev/shm/orbitkv-pages-sample-tp0.credential)  # its first line; the second is the codec
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/engines -H "Content-Type: application/json" -d @register.json -w "\n%{http_code}\n"'
run "jq '.engine_id = \"sample-tp1\"' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"

text '### List and inspect engines'
run 'curl -s http://127.0.0.1:9091/v1/engines | jq -c ".engines[] | {engine_id, namespace, codec, num_blocks, segments_per_chunk, device}"'
run 'curl -s http://127.0.0.1:9091/v1/engines/sample-tp0 | jq .'

text '### List cached objects, flush DRAM to SSD, page with the cursor'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=3" | jq .'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/admin/flush-dram | jq -c .'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=2&prefix=" | jq -c ".objects[] | {key, tier, stored_length}"'
NEXT=$(curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=2" | jq -r .next_cursor)
run "curl -s -H \"\$AUTH\" \"http://127.0.0.1:9091/v1/objects?limit=2&cursor=$NEXT\" | jq -c ."
text 'A lookup now promotes the chunks back from SSD (`lower tier 4`); `restore` compares the pages with
what was saved (`fp8` is lossy):'
run 'orbitkv-sample-engine restore'

text '### Metrics'
text 'A selection of the families (the full list is below):'
run 'curl -s http://127.0.0.1:9091/metrics | grep -E "^orbitkv_(hits|misses)_total|^orbitkv_resident_bytes|^orbitkv_pool_|^orbitkv_(save|restore)_(logical|stored)_bytes_total|^orbitkv_save_duration_seconds_count|^orbitkv_codec_(batches|segments)_total|^orbitkv_(encode|decode)_duration_seconds_count|^orbitkv_raw_segments_total\{reason=\"out_of_range|^orbitkv_decode_failures_total|^orbitkv_(reserved|workspace)_bytes|^orbitkv_evictions_total|^orbitkv_ssd_(read|write)_bytes_total|^orbitkv_ssd_corrupt_records_total|^orbitkv_ssd_backend_info"'

text '### Stats as JSON'
run 'curl -s http://127.0.0.1:9091/v1/stats | jq -c "{hits, misses, save_requests, restore_requests, resident_bytes, codec_segments, raw_segments, save_count: .durations.save.count, ssd_write_bytes: .lower.ssd_write_bytes_total, peers}"'

text '### Invalidate: by keys, by engine and chunks, by namespace, everything'
NS=$(curl -s http://127.0.0.1:9091/v1/engines/sample-tp0 | jq -r .namespace)
KEY=$(curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=1&namespace=$NS" | jq -r ".objects[0].key")
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"keys\": [\"$KEY\"]}' | jq -c ."
CHUNK=$(echo $KEY | cut -d/ -f2)
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"engine_id\": \"sample-tp0\", \"chunks\": [\"$CHUNK\"]}' | jq -c ."
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"namespace\": \"$NS\"}' | jq -c ."
run 'orbitkv-sample-engine save'
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"all\": true}' | jq -c ."

text '### Errors'
run 'curl -s -X POST http://127.0.0.1:9091/v1/invalidate -H "Content-Type: application/json" -d "{\"all\": true}" -w "\n%{http_code}\n"'
run 'curl -s -X POST -H "Authorization: Bearer wrong-token-wrong-token" http://127.0.0.1:9091/v1/admin/flush-dram -w "\n%{http_code}\n"'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/invalidate -w "\n%{http_code}\n"'
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H \"Content-Type: application/json\" -d '{\"all\": true, \"namespace\": \"$NS\"}' -w '\n%{http_code}\n'"
run 'head -c 5000000 /dev/zero | curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/invalidate -H "Content-Type: application/json" --data-binary @- -w "\n%{http_code}\n"'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=5000" -w "\n%{http_code}\n"'
run 'curl -s http://127.0.0.1:9091/v1/peers -w "\n%{http_code}\n"'

text '### OpenAPI'
run 'curl -s -o /dev/null -w "%{http_code} %{content_type}\n" http://127.0.0.1:9091/docs'
run 'curl -s http://127.0.0.1:9091/openapi.json | jq -c ".paths | keys"'

text '### Unregister'
text 'A registration that carries `pid` (the engine'"'"'s process id on the Manager'"'"'s host; the connectors send
it) and optionally `pid_start_time` (field 22 of `/proc/PID/stat`: with it the Manager watches the pid only
if it is that process, so another PID namespace or a reused pid is never taken for the engine) needs no
`DELETE` when the engine dies: the Manager checks watched engines'"'"' processes every second and unregisters
a dead one the same way (`orbitkv_engines_reaped_total` counts them). Without `pid` (as the sample engine
registers) an engine stays until it is deleted; `orbitkv-sample-engine clean` unregisters it (if it still
is, with the credential it kept) and removes its pages file and credential:'
run 'curl -s -i -X DELETE -H "$AUTH" http://127.0.0.1:9091/v1/engines/rest-tp0'
run 'curl -s http://127.0.0.1:9091/v1/engines/rest-tp0 -w "\n%{http_code}\n"'
run 'orbitkv-sample-engine clean --engine-id rest-tp0'
run 'orbitkv-sample-engine clean'
run 'kill %1 && wait && rm /tmp/ssd0.bin'
printf '```\n'
exec >&4 2>&3
kill -TERM $MGR 2>/dev/null
cat transcript.md
echo "admin token occurrences in the log and the transcript: $(cat manager.log transcript.md | grep -c "$ORBITKV_ADMIN_TOKEN")" >&3
echo "engine credential occurrences in the log and the transcript: $(cat manager.log transcript.md | grep -c -e "$SAMPLE_CREDENTIAL" -e "$(head -1 rest-registered.json | jq -r .credential)")" >&3
