#include "io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "io/durable_file.h"

namespace rp {
namespace {

using json = nlohmann::json;

// Reads and writes go in pieces of this size, so that progress moves inside large tensors.
constexpr uint64_t kPieceBytes = uint64_t{64} << 20;

[[noreturn]] void io_fail(const std::string &path, const std::string &what) {
    fail(ErrorKind::Io, path + ": " + what);
}

struct DtypeInfo {
    const char *name;
    at::ScalarType type;
};

const DtypeInfo kDtypes[] = {{"F32", at::kFloat},  {"F16", at::kHalf}, {"BF16", at::kBFloat16},
                             {"F64", at::kDouble}, {"I64", at::kLong}, {"I32", at::kInt},
                             {"I8", at::kChar},    {"U8", at::kByte},  {"BOOL", at::kBool}};

const char *dtype_name(at::ScalarType t) {
    for (const DtypeInfo &d : kDtypes)
        if (d.type == t)
            return d.name;
    fail(ErrorKind::InvalidArgument,
         std::string("cannot store dtype ") + c10::toString(t) + " in safetensors");
}

} // namespace

namespace {

// One tensor of a validated header: where its bytes lie in the data section.
struct Entry {
    std::string name;
    at::ScalarType type;
    std::vector<int64_t> shape;
    uint64_t begin = 0, nbytes = 0;
};

uint64_t header_length(const std::string &path, const unsigned char *len_bytes,
                       uint64_t file_size) {
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i)
        header_len = (header_len << 8) | len_bytes[i];
    if (header_len > file_size - 8 || header_len > (100u << 20))
        io_fail(path, "corrupt: header length " + std::to_string(header_len) +
                          " does not fit the file of " + std::to_string(file_size) + " bytes");
    return header_len;
}

// Validates every entry (dtype, shape, offsets inside the data section) before any is used.
std::vector<Entry> parse_entries(const std::string &path, const std::string &header,
                                 uint64_t data_size) {
    json h;
    try {
        h = json::parse(header);
    } catch (const json::exception &e) {
        // Includes numbers out of range (1e400), which nlohmann reports as out_of_range.
        io_fail(path, std::string("corrupt header (not JSON): ") + e.what());
    }
    if (!h.is_object())
        io_fail(path, "corrupt header: not a JSON object");
    std::vector<Entry> out;
    for (auto it = h.begin(); it != h.end(); ++it) {
        if (it.key() == "__metadata__")
            continue;
        const std::string where = "tensor \"" + it.key() + "\": ";
        const json &e = it.value();
        if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
            !e.contains("data_offsets") || !e["dtype"].is_string() || !e["shape"].is_array() ||
            !e["data_offsets"].is_array() || e["data_offsets"].size() != 2)
            io_fail(path, where + "corrupt entry " + e.dump());
        const DtypeInfo *info = nullptr;
        for (const DtypeInfo &d : kDtypes)
            if (e["dtype"] == d.name)
                info = &d;
        if (!info)
            io_fail(path, where + "unsupported dtype " + e["dtype"].dump());
        Entry entry;
        entry.name = it.key();
        entry.type = info->type;
        // Sizes come from the file: every product is checked, so that a shape whose element
        // count wraps around cannot pass as a small tensor.
        constexpr uint64_t kMaxSize = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
        uint64_t numel = 1;
        bool overflow = false;
        for (const json &d : e["shape"]) {
            if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxSize)
                io_fail(path, where + "corrupt shape " + e["shape"].dump() + ": dimension " +
                                  d.dump() + " is not a size");
            entry.shape.push_back(d.get<int64_t>());
            overflow = overflow || __builtin_mul_overflow(numel, d.get<uint64_t>(), &numel);
        }
        uint64_t nbytes = 0;
        if (overflow || numel > kMaxSize ||
            __builtin_mul_overflow(numel, c10::elementSize(info->type), &nbytes) ||
            nbytes > kMaxSize)
            io_fail(path,
                    where + "corrupt shape " + e["shape"].dump() + ": its size overflows int64");
        const json &off = e["data_offsets"];
        if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
            io_fail(path, where + "corrupt data_offsets " + off.dump());
        uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
        if (begin > end || end > data_size)
            io_fail(path, where + "data_offsets [" + std::to_string(begin) + ", " +
                              std::to_string(end) + "] lie outside the " +
                              std::to_string(data_size) + " data bytes (truncated file?)");
        if (end - begin != nbytes)
            io_fail(path, where + "holds " + std::to_string(end - begin) + " bytes but its shape " +
                              e["shape"].dump() + " and dtype need " + std::to_string(nbytes));
        entry.begin = begin;
        entry.nbytes = nbytes;
        out.push_back(std::move(entry));
    }
    return out;
}

// A folder or a device opens (and a folder even reads as a few bytes on some file systems); only
// a regular file has a size to check the header against.
void require_regular_file(const std::string &path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0)
        io_fail(path, std::string("cannot open: ") + std::strerror(errno));
    if (S_ISDIR(st.st_mode))
        io_fail(path, "is a directory, not a safetensors file");
    if (!S_ISREG(st.st_mode))
        io_fail(path, "is not a regular file, not a safetensors file");
}

// A read-only memory mapping, unmapped when the last tensor viewing it dies.
struct Mapping {
    void *addr = nullptr;
    size_t size = 0;
    ~Mapping() {
        if (addr)
            ::munmap(addr, size);
    }
};

} // namespace

std::vector<NamedTensor> read_safetensors(const std::string &path, const TensorFilter &wanted) {
    require_regular_file(path);
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in)
        io_fail(path, std::string("cannot open: ") + std::strerror(errno));
    const std::streamoff end = in.tellg();
    if (end < 0)
        io_fail(path, "cannot determine the file size");
    const uint64_t file_size = static_cast<uint64_t>(end);
    in.seekg(0);
    if (file_size < 8)
        io_fail(path, "truncated: " + std::to_string(file_size) + " bytes, not a safetensors file");
    unsigned char len_bytes[8];
    if (!in.read(reinterpret_cast<char *>(len_bytes), 8))
        io_fail(path, "read failed (header length)");
    const uint64_t header_len = header_length(path, len_bytes, file_size);
    std::string header(header_len, '\0');
    if (!in.read(header.data(), static_cast<std::streamsize>(header_len)))
        io_fail(path, "read failed (header)");
    std::vector<Entry> entries = parse_entries(path, header, file_size - 8 - header_len);
    // Tensors the caller does not want are never read nor allocated: a file may declare huge
    // ones that the model does not use.
    if (wanted)
        entries.erase(
            std::remove_if(entries.begin(), entries.end(),
                           [&](const Entry &e) { return !wanted(e.name, e.type, e.shape); }),
            entries.end());

    uint64_t total = 0;
    for (const Entry &e : entries)
        total += e.nbytes;
    ProgressReport progress("load " + path, static_cast<int64_t>(total));
    std::vector<NamedTensor> out;
    for (const Entry &e : entries) {
        at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
        in.seekg(static_cast<std::streamoff>(8 + header_len + e.begin));
        char *data = static_cast<char *>(t.data_ptr());
        for (uint64_t at = 0; at < e.nbytes; at += kPieceBytes) {
            const uint64_t n = std::min(kPieceBytes, e.nbytes - at);
            in.read(data + at, static_cast<std::streamsize>(n));
            if (!in)
                io_fail(path, "tensor \"" + e.name + "\": read failed (truncated file?)");
            progress.advance(static_cast<int64_t>(n));
        }
        out.push_back({e.name, t});
    }
    progress.finish();
    return out;
}

std::vector<NamedTensor> map_safetensors(const std::string &path) {
    require_regular_file(path);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        io_fail(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        io_fail(path, std::string("cannot stat: ") + std::strerror(err));
    }
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8) {
        ::close(fd);
        io_fail(path, "truncated: " + std::to_string(file_size) + " bytes, not a safetensors file");
    }
    auto mapping = std::make_shared<Mapping>();
    void *addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    ::close(fd);
    if (addr == MAP_FAILED)
        io_fail(path, std::string("cannot map: ") + std::strerror(map_errno));
    mapping->addr = addr;
    mapping->size = file_size;
    const auto *bytes = static_cast<const unsigned char *>(addr);
    const uint64_t header_len = header_length(path, bytes, file_size);
    std::string header(reinterpret_cast<const char *>(bytes + 8), header_len);
    std::vector<Entry> entries = parse_entries(path, header, file_size - 8 - header_len);

    std::vector<NamedTensor> out;
    for (const Entry &e : entries) {
        void *data = const_cast<unsigned char *>(bytes + 8 + header_len + e.begin);
        at::Tensor t = at::from_blob(
            data, e.shape, [mapping](void *) {}, at::TensorOptions().dtype(e.type));
        out.push_back({e.name, t});
    }
    return out;
}

int64_t tensor_bytes(const std::vector<NamedTensor> &tensors) {
    int64_t total = 0;
    for (const NamedTensor &nt : tensors)
        total += nt.tensor.numel() * static_cast<int64_t>(nt.tensor.element_size());
    return total;
}

void write_safetensors(const std::string &path, const std::vector<NamedTensor> &tensors,
                       const std::map<std::string, std::string> &metadata,
                       ProgressReport *progress) {
    std::unique_ptr<ProgressReport> own;
    if (!progress) {
        own = std::make_unique<ProgressReport>("save " + path, tensor_bytes(tensors));
        progress = own.get();
    }
    json h = json::object();
    if (!metadata.empty())
        h["__metadata__"] = metadata;
    uint64_t offset = 0;
    std::vector<at::Tensor> contiguous;
    for (const NamedTensor &nt : tensors) {
        at::Tensor t = nt.produce ? nt.tensor : nt.tensor.to(at::kCPU).contiguous();
        uint64_t nbytes = t.numel() * t.element_size();
        h[nt.name] = {{"dtype", dtype_name(t.scalar_type())},
                      {"shape", t.sizes().vec()},
                      {"data_offsets", {offset, offset + nbytes}}};
        offset += nbytes;
        contiguous.push_back(nt.produce ? at::Tensor() : t);
    }
    std::string header = h.dump();
    header.append((8 - header.size() % 8) % 8, ' '); // keeps the data 8-byte aligned
    // A save killed earlier left its temporary here; this save to the same path removes it.
    const std::string dir = parent_dir(path), file = path.substr(path.find_last_of('/') + 1);
    remove_stale_temporaries(dir, [&](const std::string &name) { return name == file; });
    const std::string tmp = temporary_name(path);
    std::FILE *f = std::fopen(tmp.c_str(), "wb");
    if (!f)
        io_fail(path, std::string("cannot create temporary file: ") + std::strerror(errno));
    bool ok = true;
    unsigned char len_bytes[8];
    uint64_t len = header.size();
    for (int i = 0; i < 8; ++i)
        len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
    ok = ok && std::fwrite(len_bytes, 1, 8, f) == 8;
    ok = ok && std::fwrite(header.data(), 1, header.size(), f) == header.size();
    for (size_t i = 0; ok && i < tensors.size(); ++i) {
        at::Tensor t = contiguous[i];
        if (!t.defined()) { // produced now, and freed after this tensor is written
            t = tensors[i].produce().to(at::kCPU).contiguous();
            if (t.scalar_type() != tensors[i].tensor.scalar_type() ||
                t.sizes() != tensors[i].tensor.sizes())
                fail(ErrorKind::Internal, "tensor \"" + tensors[i].name +
                                              "\" was produced with another dtype or shape "
                                              "than its header entry");
        }
        const uint64_t nbytes = t.numel() * t.element_size();
        const char *data = static_cast<const char *>(t.data_ptr());
        for (uint64_t at = 0; ok && at < nbytes; at += kPieceBytes) {
            const size_t n = static_cast<size_t>(std::min(kPieceBytes, nbytes - at));
            ok = std::fwrite(data + at, 1, n, f) == n;
            progress->advance(static_cast<int64_t>(n));
        }
    }
    ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    int saved_errno = errno;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
        if (ok)
            saved_errno = errno;
        std::remove(tmp.c_str());
        io_fail(path, std::string("write failed: ") + std::strerror(saved_errno));
    }
    sync_dir(dir); // the rename itself survives a power cut
    if (own)
        own->finish();
}

} // namespace rp
