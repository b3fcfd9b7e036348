#!/usr/bin/env bash
# Make a swarm's certificates for mutual TLS: a CA, one certificate every node shares (name
# `layerswarm-node`, so nodes can move between addresses) and one for the coordinator (a client).
#
#   deploy/make-certs.sh certs/            # then:
#   layerswarm node ... --tls-cert certs/node.pem --tls-key certs/node.key --tls-ca certs/ca.pem
#   layerswarm coordinator ... --tls-cert certs/coordinator.pem --tls-key certs/coordinator.key --tls-ca certs/ca.pem
#   head -c 32 /dev/urandom | base64 > certs/token   # optional shared token: --token-file certs/token
#
# Keep ca.key offline; give each device only its own key. Certificates are valid for DAYS (365).
set -euo pipefail
out="${1:?usage: make-certs.sh OUT_DIR}"
days="${DAYS:-365}"
mkdir -p "$out"
cd "$out"
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
  -days "$days" -subj "/CN=layerswarm swarm CA" 2>/dev/null
issue() {  # name, subject CN, extensions
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days "$days" \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
issue node layerswarm-node "subjectAltName=DNS:layerswarm-node
extendedKeyUsage=serverAuth,clientAuth"
issue coordinator layerswarm-coordinator "extendedKeyUsage=clientAuth"
chmod 644 ca.pem node.pem coordinator.pem
echo "wrote $(pwd)/{ca,node,coordinator}.{pem,key}"
