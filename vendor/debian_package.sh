# Sourced by the build scripts beside it: one Debian package from another suite,
# downloaded and unpacked into a private directory (nothing is installed system-wide
# and the system's apt sources stay as they are).
#   debian_package SUITE PACKAGE[=VERSION] DEST
debian_package() {
  local suite=$1 package=$2 dest=$3
  local work
  work=$(mktemp -d)
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$dest"
  cat > "$work/extra.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  local opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work"
              -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
  apt-get "${opts[@]}" update -qq
  (cd "$work" && apt-get "${opts[@]}" download "$package")
  dpkg-deb -x "$work"/*.deb "$dest"
  rm -rf "$work"
}
