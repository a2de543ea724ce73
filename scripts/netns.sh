# Sourced by the scripts that start local servers (after their `cd` to the project root): as root,
# re-executes the calling script, with its arguments, in a loopback-only network namespace (through
# bash, so a script checked out without its exec bit works too). Ray and vLLM listen on every
# interface; in there nothing outside this machine can reach them.
if [ -z "${PREFILLSHARE_NETNS:-}" ] && [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  PREFILLSHARE_NETNS=1 exec unshare -n bash -c 'ip link set lo up && exec bash "$0" "$@"' "$0" "$@"
fi
