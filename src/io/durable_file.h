// Crash-safe replacement of files: a file is written completely under a temporary name in its
// own folder, synced, then renamed over the old one, and the folder is synced, so that a reader
// (or the disk after a power cut) sees the old file or the new one, never a mix. A writer killed
// half-way leaves its temporary behind; the next writer to the same place removes it.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace rp {

// "<path>.tmp.<pid>": where this process writes `path` before renaming it into place. The pid
// tells a later writer whether the temporary belongs to a process that still runs.
std::string temporary_name(const std::string &path);

// The folder that holds `path` ("." for a bare file name).
std::string parent_dir(const std::string &path);

// `dir`/`name`.
std::string path_join(const std::string &dir, const std::string &name);

// Names of the entries of `dir`, without "." and "..". Throws rp::Error(Io) naming `dir`.
std::vector<std::string> list_dir(const std::string &dir);

// Makes the renames and removals done in `dir` durable (fsync of the folder). A file system
// that cannot sync folders (EINVAL) is accepted. Throws rp::Error(Io) naming `dir`.
void sync_dir(const std::string &dir);

// Writes `text` to temporary_name(`path`), flushed and synced, and returns that name; the
// caller renames it into place (rename_into_place) or removes it. Throws rp::Error(Io).
std::string stage_text_file(const std::string &path, const std::string &text);

// Renames `from` over `to` (one atomic step); on failure removes `from` and throws
// rp::Error(Io) naming `to`. The caller syncs the folder.
void rename_into_place(const std::string &from, const std::string &to);

// Removes the entries "<name>.tmp.<pid>" of `dir` for which `ours(name)` holds and no process
// `pid` runs any more (a writer that was killed); temporaries of running processes, this one
// included, are left alone. Returns how many were removed; failures to remove are logged.
int remove_stale_temporaries(const std::string &dir,
                             const std::function<bool(const std::string &name)> &ours);

} // namespace rp
