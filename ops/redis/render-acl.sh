#!/bin/sh
# Writes the Redis ACL file from its template (users.acl) and the passwords in the environment,
# then runs the given command (redis-server ...) through the image's own entrypoint when there is
# one. Used as the entrypoint of the `redis` service in docker-compose.yml.
#
#   TASKLOOP_ACL_TEMPLATE  the template   (default /usr/local/etc/redis/users.acl)
#   TASKLOOP_ACL_FILE      the file written (default /data/users.acl, as redis.conf's aclfile says)
#
# Passwords may hold only letters, digits and . _ ~ - (URL-safe: they go into redis:// URLs as
# they are), are 16 characters at least, and may not be the examples of .env.example (change-me...).
# Generate them with `openssl rand -hex 32`.
set -eu

template=${TASKLOOP_ACL_TEMPLATE:-/usr/local/etc/redis/users.acl}
target=${TASKLOOP_ACL_FILE:-/data/users.acl}

for name in REDIS_PASSWORD REDIS_WORKER_PASSWORD REDIS_CLIENT_PASSWORD REDIS_MONITOR_PASSWORD REDIS_FLOWER_PASSWORD; do
  eval "value=\${$name:-}"
  if [ -z "$value" ]; then
    echo "render-acl: $name is not set (copy .env.example to .env and fill it in)" >&2
    exit 1
  fi
  case $value in
    *[!A-Za-z0-9._~-]*)
      echo "render-acl: $name may contain only letters, digits and . _ ~ - (try: openssl rand -hex 32)" >&2
      exit 1 ;;
  esac
  if [ ${#value} -lt 16 ]; then
    echo "render-acl: $name is shorter than 16 characters" >&2
    exit 1
  fi
  case $value in
    change-me*)
      echo "render-acl: $name is still the published example value of .env.example; set your own (openssl rand -hex 32)" >&2
      exit 1 ;;
  esac
done

umask 077
awk '
  {
    line = $0
    for (name in ENVIRON) {
      if (name !~ /^REDIS_[A-Z_]*PASSWORD$/) continue
      token = "${" name "}"
      while ((at = index(line, token)) > 0)
        line = substr(line, 1, at - 1) ENVIRON[name] substr(line, at + length(token))
    }
    if (line ~ /\$\{/) { print "render-acl: unresolved ${...} placeholder on line " NR " of the template" > "/dev/stderr"; exit 1 }
    print line
  }' "$template" > "$target.tmp"
mv "$target.tmp" "$target"

if [ "${1:-}" = "redis-server" ] && command -v docker-entrypoint.sh >/dev/null 2>&1; then
  exec docker-entrypoint.sh "$@"  # the redis image's entrypoint: drops root, fixes /data ownership
fi
exec "$@"
