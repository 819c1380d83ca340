#include "io/durable_file.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <dirent.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include "base/error.h"
#include "base/log.h"

namespace rp {

namespace {

[[noreturn]] void io_fail(const std::string &path, const std::string &what, int err) {
    fail(ErrorKind::Io, path + ": " + what + ": " + std::strerror(err));
}

// Whether process `pid` is gone. EPERM means it exists under another user; a zombie still
// counts as running until its parent reaps it.
bool process_gone(long pid) {
    if (pid <= 0 || pid > 0x7fffffffL || pid == static_cast<long>(::getpid()))
        return false; // not a pid this file could name, or this process's own
    return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// Whether `name` is "<base>.tmp.<digits>"; sets `base` when it is.
bool is_temporary_name(const std::string &name, std::string *base) {
    const size_t mark = name.rfind(".tmp.");
    if (mark == std::string::npos || mark == 0)
        return false;
    const size_t digits = mark + 5;
    if (digits == name.size() || name.size() - digits > 10)
        return false;
    for (size_t i = digits; i < name.size(); ++i)
        if (name[i] < '0' || name[i] > '9')
            return false;
    *base = name.substr(0, mark);
    return true;
}

} // namespace

std::string temporary_name(const std::string &path) {
    return path + ".tmp." + std::to_string(::getpid());
}

std::string parent_dir(const std::string &path) {
    const size_t slash = path.find_last_of('/');
    if (slash == std::string::npos)
        return ".";
    return slash == 0 ? "/" : path.substr(0, slash);
}

std::string path_join(const std::string &dir, const std::string &name) {
    return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::vector<std::string> list_dir(const std::string &dir) {
    DIR *d = ::opendir(dir.c_str());
    if (!d)
        io_fail(dir, "cannot list the folder", errno);
    std::vector<std::string> names;
    while (const struct dirent *e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..")
            names.push_back(name);
    }
    ::closedir(d);
    return names;
}

void sync_dir(const std::string &dir) {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        io_fail(dir, "cannot open the folder to sync it", errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0 && err != EINVAL && err != EROFS)
        io_fail(dir, "cannot sync the folder", err);
}

std::string stage_text_file(const std::string &path, const std::string &text) {
    const std::string tmp = temporary_name(path);
    std::FILE *f = std::fopen(tmp.c_str(), "wb");
    if (!f)
        io_fail(path, "cannot create temporary file", errno);
    bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    int err = errno;
    if (std::fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (!ok) {
        std::remove(tmp.c_str());
        io_fail(path, "write failed", err);
    }
    return tmp;
}

void rename_into_place(const std::string &from, const std::string &to) {
    if (std::rename(from.c_str(), to.c_str()) != 0) {
        const int err = errno;
        std::remove(from.c_str());
        io_fail(to, "rename failed", err);
    }
}

int remove_stale_temporaries(const std::string &dir,
                             const std::function<bool(const std::string &name)> &ours) {
    std::vector<std::string> entries;
    try {
        entries = list_dir(dir);
    } catch (const Error &) {
        return 0; // the write that follows reports the folder's problem, naming the file
    }
    int removed = 0;
    for (const std::string &entry : entries) {
        std::string base;
        if (!is_temporary_name(entry, &base) || !ours(base))
            continue;
        const long pid = std::strtol(entry.c_str() + base.size() + 5, nullptr, 10);
        if (!process_gone(pid))
            continue;
        const std::string path = path_join(dir, entry);
        if (std::remove(path.c_str()) == 0)
            ++removed;
        else if (errno != ENOENT) // another writer may have cleaned it up first
            log(LogLevel::Warn, path +
                                    ": could not remove the temporary file of an interrupted "
                                    "save: " +
                                    std::strerror(errno));
    }
    return removed;
}

} // namespace rp
