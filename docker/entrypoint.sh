#!/bin/sh
# Runs the container's command as the unprivileged user dpcfl (uid 10001). Started as root, it
# first makes /results writable for it: a bind mount (./results in compose.yaml) belongs to
# whoever made it on the host, which the image cannot know. The directory is handed to dpcfl
# only when it is empty or already dpcfl's, so a host directory with files of its own is never
# taken over: its owner then gets one line on what to do.
set -e
user=dpcfl
if [ "$(id -u)" != 0 ]; then
  exec "$@"
fi
if [ -d /results ] && ! setpriv --reuid="$user" --regid="$user" --init-groups test -w /results; then
  if [ -z "$(ls -A /results)" ]; then
    chown "$user:$user" /results
  else
    echo "dpcfl: /results (owner $(stat -c '%u:%g, mode %a' /results)) is not writable by" \
      "uid $(id -u "$user") and holds files: mount an empty directory, or run" \
      "'chown $(id -u "$user") DIR' on the host" >&2
    exit 2
  fi
fi
# setpriv keeps root's environment: HOME=/root made matplotlib (imported by the ServerApp)
# warn on every start that it could not write /root/.config.
export HOME="/home/$user"
exec setpriv --reuid="$user" --regid="$user" --init-groups "$@"
