#!/usr/bin/env bash
# Make (or rotate) a swarm's certificates for mutual TLS, with separate roles:
#   ca.pem / ca.key          the swarm CA (made once; kept when it exists, so rotation replaces leaves only)
#   node.pem / node.key      serverAuth ONLY, name `layerswarm-node` (nodes can move between addresses);
#                            a node's key cannot act as a client, so a compromised node cannot drive others
#   node-DEVICE.pem / .key   optional per-device node certificates (same role and name, own key)
#   coordinator.pem / .key   clientAuth ONLY: it drives nodes and can never pose as one
#   relay.pem / relay.key    clientAuth ONLY, name `layerswarm-relay`, for nodes forwarding relay chains:
#                            nodes let it call Relay (a chain the coordinator MACed) and Info, nothing else
#   probe.pem / probe.key    clientAuth ONLY, for health probes on node devices: nodes let it reach
#                            the health service, never BlockNode (only `layerswarm-coordinator` may)
#
#   deploy/make-certs.sh certs/ [DEVICE ...]     # then:
#   layerswarm node ... --tls-cert certs/node.pem --tls-key certs/node.key --tls-ca certs/ca.pem
#       [--tls-relay-cert certs/relay.pem --tls-relay-key certs/relay.key]   # for --topology relay
#   layerswarm coordinator ... --tls-cert certs/coordinator.pem --tls-key certs/coordinator.key --tls-ca certs/ca.pem
#   layerswarm probe grpc 127.0.0.1:50051 --tls-cert certs/probe.pem --tls-key certs/probe.key --tls-ca certs/ca.pem
#   head -c 32 /dev/urandom | base64 > certs/token   # optional shared token: --token-file certs/token
#
# Rotation: run it again on the same folder: the CA is kept, every leaf certificate and key is
# replaced; restart nodes one at a time (the coordinator routes around each), then the coordinator.
# Keep ca.key offline; give each device only its own key. Leaves are valid for DAYS (365).
set -euo pipefail
out="${1:?usage: make-certs.sh OUT_DIR [NODE_DEVICE ...]}"
shift
days="${DAYS:-365}"
mkdir -p "$out"
cd "$out"
umask 077
if [ ! -f ca.key ] || [ ! -f ca.pem ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
    -days "$((days * 5))" -subj "/CN=layerswarm swarm CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
issue() {  # file name, subject CN, extra extensions
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days "$days" \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
  chmod 644 "$1.pem"
}
node_ext="subjectAltName=DNS:layerswarm-node
extendedKeyUsage=serverAuth"
issue node layerswarm-node "$node_ext"
for device in "$@"; do
  [[ "$device" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "make-certs.sh: bad device name: $device" >&2; exit 2; }
  issue "node-$device" "layerswarm-node-$device" "$node_ext"
done
issue coordinator layerswarm-coordinator "extendedKeyUsage=clientAuth"
issue probe layerswarm-probe "extendedKeyUsage=clientAuth"
issue relay layerswarm-relay "extendedKeyUsage=clientAuth"
chmod 644 ca.pem
echo "wrote $(pwd): ca.pem, coordinator.{pem,key}, node.{pem,key}, probe.{pem,key}, relay.{pem,key}; per-device node certificates: ${*:-none}"
