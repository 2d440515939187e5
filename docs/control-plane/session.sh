#!/usr/bin/env bash
# Captures the curl session of docs/control-plane.md against a real orbitkv-cache-manager
# (needs curl, jq, ports 9091-9092 free). Usage: docs/control-plane/session.sh; WORK=dir to keep files there.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-$(mktemp -d)}
cp "$HERE/mkpages.py" "$HERE/work.py" "$WORK/"
cd "$WORK"
echo "transcripts in $WORK" >&2
rm -f ssd0.bin
export ORBITKV_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
orbitkv-cache-manager --pool-size 64mb --ssd-cache-path $WORK/ssd0.bin --ssd-cache-capacity 256mb \
  --device cpu --log-level warning > manager.log 2>&1 &
MGR=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:9091/healthz >/dev/null && break; sleep 0.5; done
AUTH="Authorization: Bearer $ORBITKV_ADMIN_TOKEN"
run() { printf '$ %s\n' "$1"; eval "$1"; printf '\n'; }
exec 3>&2 > transcript.txt 2>&1
run 'curl -s http://127.0.0.1:9091/healthz'
run 'curl -s http://127.0.0.1:9091/readyz'
run 'curl -s http://127.0.0.1:9091/v1/config | jq .'
PAGES=$(python3 mkpages.py 2>/dev/null)
run "jq '{model, engine_id, codec, tensors: (.tensors | length), first_tensor: .tensors[0]}' register.json"
run 'curl -s -i -X POST http://127.0.0.1:9091/v1/engines -H "Content-Type: application/json" -d @register.json'
run "jq '.engine_id = \"other\" | .tensors[0].handle = {\"type\": \"host\", \"path\": \"/etc/passwd\", \"offset\": 0}' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.engine_id = \"other\" | .tensors[1].handle.name = \"no-such-object\"' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.engine_id = \"other\" | .tensors[0].shape[2] = 3' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run "jq '.block_size = \"16\" | .turbo = true' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
# The answer's credential is the engine's secret: kept for work.py, shown shortened.
run 'curl -s -X POST http://127.0.0.1:9091/v1/engines -H "$AUTH" -H "Content-Type: application/json" -d @register.json -w "\n%{http_code}\n" | tee registered.json | jq -c "if type == \"object\" then .credential |= .[:8] + \"...\" else . end"'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/engines -H "Content-Type: application/json" -d @register.json -w "\n%{http_code}\n"'
run "jq '.engine_id = \"vllm-tp1\"' register.json | curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/engines -H 'Content-Type: application/json' -d @- -w '\n%{http_code}\n'"
run 'curl -s http://127.0.0.1:9091/v1/engines | jq -c ".engines[] | {engine_id, namespace, codec, num_blocks, segments_per_chunk, device}"'
run 'curl -s http://127.0.0.1:9091/v1/engines/vllm-tp0 | jq .'
run 'python3 work.py 2>/dev/null'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=3" | jq .'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/admin/flush-dram | jq -c .'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=2&prefix=" | jq -c ".objects[] | {key, tier, stored_length}"'
NEXT=$(curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=2" | jq -r .next_cursor)
run "curl -s -H \"\$AUTH\" \"http://127.0.0.1:9091/v1/objects?limit=2&cursor=$NEXT\" | jq -c ."
run 'python3 work.py restore 2>/dev/null'
run 'curl -s http://127.0.0.1:9091/metrics | grep -E "^orbitkv_(hits|misses)_total|^orbitkv_resident_bytes|^orbitkv_pool_|^orbitkv_(save|restore)_(logical|stored)_bytes_total|^orbitkv_save_duration_seconds_(count|sum)|^orbitkv_save_duration_seconds_bucket\{le=\"0.0(05|1)\"|^orbitkv_codec_(batches|segments)_total|^orbitkv_(encode|decode)_duration_seconds_count|^orbitkv_raw_segments_total\{reason=\"out_of_range|^orbitkv_decode_failures_total|^orbitkv_(reserved|workspace)_bytes|^orbitkv_evictions_total|^orbitkv_ssd_(read|write)_bytes_total|^orbitkv_ssd_read_latency_p99_seconds|^orbitkv_ssd_corrupt_records_total|^orbitkv_ssd_backend_info"'
run 'curl -s http://127.0.0.1:9091/v1/stats | jq -c "{hits, misses, save_requests, restore_requests, resident_bytes, codec_segments, raw_segments, save_duration: .durations.save | {count, sum}, ssd_write_bytes: .lower.ssd_write_bytes_total, peers}"'
NS=$(curl -s http://127.0.0.1:9091/v1/engines/vllm-tp0 | jq -r .namespace)
KEY=$(curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=1" | jq -r ".objects[0].key")
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"keys\": [\"$KEY\"]}' | jq -c ."
CHUNK=$(echo $KEY | cut -d/ -f2)
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"engine_id\": \"vllm-tp0\", \"chunks\": [\"$CHUNK\"]}' | jq -c ."
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"namespace\": \"$NS\"}' | jq -c ."
run 'python3 work.py 2>/dev/null | head -1'
run "curl -s -X POST -H \"\$AUTH\" http://127.0.0.1:9091/v1/invalidate -H 'Content-Type: application/json' -d '{\"all\": true}' | jq -c ."
# Errors.
run 'curl -s -X POST http://127.0.0.1:9091/v1/invalidate -H "Content-Type: application/json" -d "{\"all\": true}" -w "\n%{http_code}\n"'
run 'curl -s -X POST -H "Authorization: Bearer wrong-token-wrong-token" http://127.0.0.1:9091/v1/admin/flush-dram -w "\n%{http_code}\n"'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/invalidate -H "Content-Type: application/json" -d "{\"all\": true, \"namespace\": \"$NS\"}" -w "\n%{http_code}\n"'
run 'head -c 5000000 /dev/zero | curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/invalidate -H "Content-Type: application/json" --data-binary @- -w "\n%{http_code}\n"'
run 'curl -s -H "$AUTH" "http://127.0.0.1:9091/v1/objects?limit=5000" -w "\n%{http_code}\n"'
run 'curl -s http://127.0.0.1:9091/v1/peers -w "\n%{http_code}\n"'
run 'curl -s -o /dev/null -w "%{http_code} %{content_type}\n" http://127.0.0.1:9091/docs'
run 'curl -s http://127.0.0.1:9091/openapi.json | jq -c ".paths | keys"'
run 'curl -s -i -X DELETE -H "$AUTH" http://127.0.0.1:9091/v1/engines/vllm-tp0'
run 'curl -s http://127.0.0.1:9091/v1/engines/vllm-tp0 -w "\n%{http_code}\n"'
kill -TERM $MGR; wait $MGR
rm -f "/dev/shm/$PAGES"
echo "admin token occurrences in logs and transcript: $(cat manager.log transcript.txt | grep -c "$ORBITKV_ADMIN_TOKEN")" >&3
echo "engine credential occurrences in logs and transcript: $(cat manager.log transcript.txt | grep -c "$(head -1 registered.json | jq -r .credential)")" >&3
