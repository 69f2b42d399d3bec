#!/bin/sh
# The compose stack's TLS certificates, NATS users and API keys, made as deploy/README.md's "By hand"
# section makes them (openssl, `asyncinfer nats-users`, SHA-256 of the keys), by the one-shot
# service `secrets` before anything else starts:
#   make-secrets.sh DIR [CONFIG]
# DIR holds one folder per volume (compose mounts each at DIR/<folder> in this step's container).
# DIR/all (the volume `secrets`, mounted by this step alone; root's only) keeps what is made:
#   ca/ca.key                      the CA's key
#   tls/ca.pem                     the CA every client verifies with
#   tls/<name>.pem, tls/<name>.key nats, gateway, scheduler, batcher (each for its compose name,
#                                  localhost and 127.0.0.1), ops (an operator's client certificate:
#                                  the scheduler requires one, mutual TLS)
#   nats/seeds/<service>.nk        the gateway's and the scheduler's NATS NKey seeds
#   api-keys/<who>                 the API keys, random at the first run: tenant-demo, ops, batcher
# and gives each service a copy of its own files alone, in its own volume (mounted read-only at
# /run/secrets/asyncinfer in that service's container, and in no other):
#   nats/       nats/nats.conf (TLS, JetStream, the users), nats/nats-users.conf (each service's
#               NKey user, allowed only its subjects: asyncinfer.nats_users), tls/nats.pem, tls/nats.key
#   gateway/    tls/ca.pem, tls/gateway.pem, tls/gateway.key, nats/seeds/gateway.nk, gateway__api_keys
#   scheduler/  tls/ca.pem, tls/scheduler.pem, tls/scheduler.key, nats/seeds/scheduler.nk, gateway__api_keys
#   batcher/    tls/ca.pem, tls/batcher.pem, tls/batcher.key, gateway__api_keys, batcher__api_key
#   operator/   (no service mounts it; deploy/README.md copies it out) ca.pem, ops.pem, ops.key and
#               api-keys.env (the tenant's and the operator's keys, as the asyncinfer CLI's variables)
# gateway__api_keys is the keys' SHA-256s with their roles, batcher__api_key the batcher's own key:
# files of the secrets directory each service reads (ASYNCINFER_SECRETS_DIR, docs/CONFIGURATION.md).
# Run at every `docker compose up`: what exists is kept (the keys, the seeds, the CA, a certificate
# with more than RENEW_DAYS left), so clients keep trusting the same CA and keys; a certificate near
# its end is issued again (the gateway, the scheduler and the batcher serve a renewed one without a
# restart; nats-server reads its own at start: `docker compose restart nats` after a renewal). A
# service's file is replaced only when it changed.
# What the services read is root's, of group 10001 (the images' user, as fsGroup gives a pod its
# Secret's files), keys 0640: so this step, root with no capability but CHOWN, reads and replaces
# its own files at the next run. SECRETS_OWNER (default 0:10001) changes that owner; "" leaves
# ownership as it is (a run as another user than root). DIR/all and DIR/operator stay this step's
# user's alone (0600).
set -eu

DIR=${1:?usage: make-secrets.sh DIR [CONFIG]}
CONFIG=${2:-}
OWNER=${SECRETS_OWNER-0:10001}
MOUNT=/run/secrets/asyncinfer  # where each service mounts its own volume (nats.conf names its files there)
CA_DAYS=3650
CERT_DAYS=90
RENEW_DAYS=30
NAMES="nats gateway scheduler batcher ops"

umask 077
mkdir -p "$DIR/all/ca" "$DIR/all/tls" "$DIR/all/nats/seeds" "$DIR/all/api-keys"
for volume in nats gateway scheduler batcher operator; do
    mkdir -p "$DIR/$volume"
done
ALL=$DIR/all
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fresh() {  # a certificate that exists, verifies against the CA and has more than RENEW_DAYS left
    [ -s "$1" ] && openssl x509 -in "$1" -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null 2>&1 \
        && openssl verify -CAfile "$ALL/tls/ca.pem" "$1" >/dev/null 2>&1
}

if ! [ -s "$ALL/ca/ca.key" ] || ! openssl x509 -in "$ALL/tls/ca.pem" -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null 2>&1; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$CA_DAYS" \
        -subj /CN=asyncinfer-compose-ca -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
    mv "$work/ca.key" "$ALL/ca/ca.key"
    mv "$work/ca.pem" "$ALL/tls/ca.pem"
    echo "made a new CA: tls/ca.pem (clients that trusted an earlier one need this one)"
fi

for name in $NAMES; do
    fresh "$ALL/tls/$name.pem" && continue
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
        -keyout "$work/$name.key" -out "$work/$name.csr" 2>/dev/null
    # Each for the name the others dial (its compose service), and for localhost: its health check
    # and the host's clients, through the ports published on 127.0.0.1.
    printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' "$name" \
        > "$work/$name.ext"
    openssl x509 -req -in "$work/$name.csr" -CA "$ALL/tls/ca.pem" -CAkey "$ALL/ca/ca.key" -CAcreateserial \
        -CAserial "$work/ca.srl" -days "$CERT_DAYS" -extfile "$work/$name.ext" -out "$work/$name.pem" 2>/dev/null
    mv "$work/$name.key" "$ALL/tls/$name.key"
    mv "$work/$name.pem" "$ALL/tls/$name.pem"
    echo "issued tls/$name.pem (valid $CERT_DAYS days)"
done

# The API keys: random at the first run (192 bits), kept after.
for who in tenant-demo ops batcher; do
    [ -s "$ALL/api-keys/$who" ] && continue
    openssl rand -hex 24 > "$work/$who"
    mv "$work/$who" "$ALL/api-keys/$who"
    echo "made the API key api-keys/$who"
done
digest() {  # the key's SHA-256, as `asyncinfer hash-key` prints it
    printf %s "$(cat "$ALL/api-keys/$1")" | sha256sum | cut -d' ' -f1
}
printf '[{"tenant": "demo", "sha256": "%s", "name": "compose tenant demo"}, {"role": "ops", "sha256": "%s", "name": "compose operator"}, {"role": "batcher", "sha256": "%s", "name": "compose batchers"}]\n' \
    "$(digest tenant-demo)" "$(digest ops)" "$(digest batcher)" > "$work/gateway__api_keys"
{
    echo "# The compose stack's API keys (deploy/compose/make-secrets.sh made them; kept across runs)."
    echo "# The asyncinfer CLI reads these variables; grpcurl: -H \"authorization: Bearer \$ASYNCINFER_API_KEY\"."
    echo "export ASYNCINFER_API_KEY=$(cat "$ALL/api-keys/tenant-demo")  # role tenant, tenant demo: the gateway's JobService"
    echo "export ASYNCINFER_OPS_KEY=$(cat "$ALL/api-keys/ops")  # role ops: the scheduler's OpsService, the batcher's KServe API"
} > "$work/api-keys.env"

# NATS: a seed per service (kept when it exists) and the users block, then the server's file.
if [ -n "$CONFIG" ]; then
    asyncinfer nats-users "$ALL/nats/seeds" --config "$CONFIG" > "$work/nats-users.conf"
else
    asyncinfer nats-users "$ALL/nats/seeds" > "$work/nats-users.conf"
fi
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
  cert_file: "$MOUNT/tls/nats.pem"
  key_file: "$MOUNT/tls/nats.key"
  timeout: 2
}
include ./nats-users.conf
EOF
# A volume `secrets` of the release before held the services' files themselves: they are theirs now.
rm -f "$ALL/nats/nats.conf" "$ALL/nats/nats-users.conf"
chmod -R go= "$ALL"

# give SOURCE VOLUME/PATH MODE [OWNER]: the file, in place when it changed (a new file moved over
# the old one, its mode and owner already set, so that a service never reads half of it).
give() {
    target=$DIR/$2
    mkdir -p "$(dirname "$target")"
    if ! cmp -s "$1" "$target"; then
        cp "$1" "$target.new"
        chmod "$3" "$target.new"
        mv "$target.new" "$target"
    fi
    chmod "$3" "$target"
    if [ -n "${4-$OWNER}" ]; then
        chown "${4-$OWNER}" "$target"
    fi
}
give "$work/nats.conf" nats/nats/nats.conf 644
give "$work/nats-users.conf" nats/nats/nats-users.conf 644
for name in nats gateway scheduler batcher; do
    give "$ALL/tls/$name.key" "$name/tls/$name.key" 640
    give "$ALL/tls/$name.pem" "$name/tls/$name.pem" 644
done
for name in gateway scheduler batcher; do
    give "$ALL/tls/ca.pem" "$name/tls/ca.pem" 644
    give "$work/gateway__api_keys" "$name/gateway__api_keys" 640
done
for name in gateway scheduler; do
    give "$ALL/nats/seeds/$name.nk" "$name/nats/seeds/$name.nk" 640
done
give "$ALL/api-keys/batcher" batcher/batcher__api_key 640
# The operator's: this step's user's alone (read out with `docker compose run ... secrets`).
give "$ALL/tls/ca.pem" operator/ca.pem 600 ""
give "$ALL/tls/ops.pem" operator/ops.pem 600 ""
give "$ALL/tls/ops.key" operator/ops.key 600 ""
give "$work/api-keys.env" operator/api-keys.env 600 ""

for volume in nats gateway scheduler batcher; do
    find "$DIR/$volume" -type d -exec chmod 755 {} +
done
chmod 700 "$DIR/operator"
echo "secrets ready in $DIR"
