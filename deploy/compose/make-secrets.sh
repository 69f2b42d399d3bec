#!/bin/sh
# The compose stack's TLS certificates and NATS users, made as deploy/README.md's "By hand" section
# makes them (openssl, `asyncinfer nats-users`), by the one-shot service `secrets` before anything
# else starts:
#   make-secrets.sh DIR [CONFIG]
# DIR (the volume `secrets`, mounted at the same path in every container, so the paths written
# into nats.conf hold everywhere) gets:
#   ca/ca.key                      the CA's key: root's alone (the services run as 10001, no capabilities)
#   tls/ca.pem                     the CA every client verifies with (give it to grpcurl, --tls-ca)
#   tls/<name>.pem, tls/<name>.key nats, gateway, scheduler, batcher (each for its compose name,
#                                  localhost and 127.0.0.1), ops (an operator's client certificate:
#                                  the scheduler requires one, mutual TLS)
#   nats/seeds/<service>.nk        the gateway's and the scheduler's NATS NKey seeds
#   nats/nats-users.conf           their users, each allowed only its subjects (asyncinfer.nats_users)
#   nats/nats.conf                 the nats-server file: TLS, JetStream, the users
# Run at every `docker compose up`: what exists is kept (the seeds, the CA, a certificate with more
# than RENEW_DAYS left), so clients keep trusting the same CA; a certificate near its end is issued
# again (the gateway, the scheduler and the batcher serve a renewed one without a restart;
# nats-server reads its own at start: `docker compose restart nats` after a renewal).
# What the services read is root's, of group 10001 (the images' user, as fsGroup gives a pod its
# Secret's files), keys 0640: so this step, root with no capability but CHOWN, reads and replaces
# its own files at the next run. SECRETS_OWNER (default 0:10001) changes that owner; "" leaves
# ownership as it is (a run as another user than root).
set -eu

DIR=${1:?usage: make-secrets.sh DIR [CONFIG]}
CONFIG=${2:-}
OWNER=${SECRETS_OWNER-0:10001}
CA_DAYS=3650
CERT_DAYS=90
RENEW_DAYS=30
NAMES="nats gateway scheduler batcher ops"

umask 077
mkdir -p "$DIR/ca" "$DIR/tls" "$DIR/nats/seeds"
DIR=$(cd "$DIR" && pwd)  # absolute: nats.conf names its files by it
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fresh() {  # a certificate that exists, verifies against the CA and has more than RENEW_DAYS left
    [ -s "$1" ] && openssl x509 -in "$1" -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null 2>&1 \
        && openssl verify -CAfile "$DIR/tls/ca.pem" "$1" >/dev/null 2>&1
}

if ! [ -s "$DIR/ca/ca.key" ] || ! openssl x509 -in "$DIR/tls/ca.pem" -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null 2>&1; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$CA_DAYS" \
        -subj /CN=asyncinfer-compose-ca -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
    mv "$work/ca.key" "$DIR/ca/ca.key"
    mv "$work/ca.pem" "$DIR/tls/ca.pem"
    echo "made a new CA: tls/ca.pem (clients that trusted an earlier one need this one)"
fi

for name in $NAMES; do
    fresh "$DIR/tls/$name.pem" && continue
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
        -keyout "$work/$name.key" -out "$work/$name.csr" 2>/dev/null
    # Each for the name the others dial (its compose service), and for localhost: its health check
    # and the host's clients, through the ports published on 127.0.0.1.
    printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' "$name" \
        > "$work/$name.ext"
    openssl x509 -req -in "$work/$name.csr" -CA "$DIR/tls/ca.pem" -CAkey "$DIR/ca/ca.key" -CAcreateserial \
        -CAserial "$work/ca.srl" -days "$CERT_DAYS" -extfile "$work/$name.ext" -out "$work/$name.pem" 2>/dev/null
    mv "$work/$name.key" "$DIR/tls/$name.key"
    mv "$work/$name.pem" "$DIR/tls/$name.pem"
    echo "issued tls/$name.pem (valid $CERT_DAYS days)"
done

# NATS: a seed per service (kept when it exists) and the users block, then the server's file.
if [ -n "$CONFIG" ]; then
    asyncinfer nats-users "$DIR/nats/seeds" --config "$CONFIG" > "$work/nats-users.conf"
else
    asyncinfer nats-users "$DIR/nats/seeds" > "$work/nats-users.conf"
fi
mv "$work/nats-users.conf" "$DIR/nats/nats-users.conf"
cat > "$work/nats.conf" <<EOF
# Written by deploy/compose/make-secrets.sh at each start of the stack; edit that script.
server_name: nats-compose
port: 4222
http_port: 8222
# Room for a 4 MiB SubmitJob (gateway.max_request_bytes) in one work message.
max_payload: 8MB
jetstream { store_dir: "/data" }
# Clients speak TLS (the services verify the server against tls/ca.pem).
tls {
  cert_file: "$DIR/tls/nats.pem"
  key_file: "$DIR/tls/nats.key"
  timeout: 2
}
include ./nats-users.conf
EOF
mv "$work/nats.conf" "$DIR/nats/nats.conf"

chmod 700 "$DIR/ca"
chmod 600 "$DIR/ca/ca.key"
chmod 755 "$DIR" "$DIR/tls" "$DIR/nats" "$DIR/nats/seeds"
chmod 644 "$DIR/tls/"*.pem "$DIR/nats/nats.conf" "$DIR/nats/nats-users.conf"
chmod 640 "$DIR/tls/"*.key "$DIR/nats/seeds/"*.nk
if [ -n "$OWNER" ]; then
    chown "$OWNER" "$DIR/tls/"* "$DIR/nats/seeds/"*
fi
echo "secrets ready in $DIR"
