#!/usr/bin/env bash
# The /v1/peers part of docs/control-plane.md: two managers on one host, peer sharing on
# (needs curl, jq, the mooncake wheel, ports 9091-9094 and 9300-9301 free).
set -u
WORK=${WORK:-$(mktemp -d)}
cd "$WORK"
echo "transcripts in $WORK" >&2
export ORBITKV_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
orbitkv-cache-manager --pool-size 64mb --device cpu --log-level warning --peer-port 9300 > mgrA.log 2>&1 &
A=$!
orbitkv-cache-manager --pool-size 64mb --device cpu --log-level warning --peer-port 9301 \
  --http-addr 127.0.0.1:9093 --data-plane tcp://127.0.0.1:9094 > mgrB.log 2>&1 &
B=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:9091/healthz >/dev/null && curl -sf http://127.0.0.1:9093/healthz >/dev/null && break; sleep 0.5; done
AUTH="Authorization: Bearer $ORBITKV_ADMIN_TOKEN"
run() { printf '$ %s\n' "$1"; eval "$1"; printf '\n'; }
exec 3>&2 > transcript_peers.txt 2>&1
run 'curl -s http://127.0.0.1:9091/v1/peers | jq -c .'
run 'curl -s -X POST http://127.0.0.1:9091/v1/peers -H "Content-Type: application/json" -d "{\"address\": \"127.0.0.1:9301\"}" -w "\n%{http_code}\n"'
run 'curl -s -X POST -H "$AUTH" http://127.0.0.1:9091/v1/peers -H "Content-Type: application/json" -d "{\"address\": \"127.0.0.1:9301\"}" -w "\n%{http_code}\n"'
run 'curl -s http://127.0.0.1:9091/v1/peers/127.0.0.1:9301 | jq -c .'
run 'curl -s http://127.0.0.1:9091/v1/peers/stats | jq -c "{session_id, address, lookups_total, keys_fetched_total, fetched_bytes_total, failures_total, peers: (.peers | length)}"'
run 'curl -s http://127.0.0.1:9091/metrics | grep -E "^orbitkv_peer_(lookups|keys_fetched|fetched_bytes)_total|^orbitkv_peers|^orbitkv_hits_total\{tier=\"peer\"|^orbitkv_peer_hit_latency_seconds_count"'
run 'curl -s -i -X DELETE -H "$AUTH" http://127.0.0.1:9091/v1/peers/127.0.0.1:9301'
run 'curl -s http://127.0.0.1:9091/v1/peers/127.0.0.1:9301 -w "\n%{http_code}\n"'
kill -TERM $A $B; wait $A $B
echo "admin token occurrences in logs and transcript: $(cat mgrA.log mgrB.log transcript_peers.txt | grep -c "$ORBITKV_ADMIN_TOKEN")" >&3
