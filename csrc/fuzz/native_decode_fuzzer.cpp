// libFuzzer target for the native rANS coder (csrc/rans_cpu.cpp), built with AddressSanitizer
// and UndefinedBehaviorSanitizer by cachegen_core/testing/fuzz/native.py:
//
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
//       -I csrc csrc/fuzz/native_decode_fuzzer.cpp csrc/rans_cpu.cpp -pthread -o native_decode_fuzzer
//
// The first bytes of an input choose a layout (substreams, symbols per substream, period,
// alphabet, tables, threads) and frequency tables; the rest are the substream payloads.
// Mode 0 decodes the payloads as they are: any result code is fine, an out-of-bounds
// access, an overflow or a symbol outside the alphabet is a finding. Mode 1 takes the
// rest as symbols, encodes them and decodes them back: they must round-trip exactly.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

extern "C" {
int cg_build_tables(const uint32_t* freqs, int32_t n_tables, int32_t alphabet, int32_t lut_bits, uint32_t* info,
                    uint8_t* lut);
int cg_encode(const uint8_t* symbols, const int64_t* sym_offsets, int32_t n_streams, const int32_t* table_ids,
              int32_t period, const uint32_t* info, int32_t n_tables, int32_t alphabet, uint8_t* out,
              const int64_t* out_offsets, int64_t* out_sizes, int32_t n_threads);
int cg_decode(const uint8_t* in, const int64_t* in_offsets, int32_t n_streams, const int64_t* sym_offsets,
              const int32_t* table_ids, int32_t period, const uint32_t* info, const uint8_t* lut, int32_t lut_bits,
              int32_t n_tables, int32_t alphabet, uint8_t* out, int32_t* status, int32_t n_threads);
int64_t cg_encode_bound(int64_t n);
}

namespace {

struct Reader {
    const uint8_t* p;
    size_t n;
    uint32_t u8() { return n ? (--n, *p++) : 0; }
    uint32_t u16() { return u8() | (u8() << 8); }
};

// Tables from input bytes: counts of the first few symbols from the input, normalised to 2^16, each >= 1.
std::vector<uint32_t> make_freqs(Reader& r, int n_tables, int alphabet) {
    std::vector<uint32_t> f((size_t)n_tables * alphabet);
    for (int t = 0; t < n_tables; ++t) {
        uint32_t* row = &f[(size_t)t * alphabet];
        std::vector<uint32_t> c(alphabet, 0);
        int peaked = r.u8() & 3;
        for (int s = 0; s < alphabet && s < 8; ++s) c[s] = peaked == 0 ? 0 : r.u8();
        if (peaked == 0) c[r.u8() % alphabet] = 1000000;
        uint64_t total = 0;
        for (int s = 0; s < alphabet; ++s) total += c[s];
        uint32_t budget = (1u << 16) - alphabet, used = 0;
        for (int s = 0; s < alphabet; ++s) {
            row[s] = 1 + (total ? (uint32_t)((uint64_t)c[s] * budget / total) : budget / alphabet);
            used += row[s];
        }
        row[0] += (1u << 16) - used;  // the rounding remainder
    }
    return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Reader r{data, size};
    const int mode = r.u8() & 1;
    const int n_streams = 1 + (int)(r.u8() % 4);
    const int period = 1 + (int)(r.u8() % 20);
    const int alphabet = 2 + (int)(r.u8() % 255);
    const int n_tables = 1 + (int)(r.u8() % 3);
    const int lut_bits = 1 + (int)(r.u8() % 16);
    const int threads = 1 + (int)(r.u8() % 2);
    std::vector<int64_t> sym_off(n_streams + 1, 0);
    for (int s = 0; s < n_streams; ++s) sym_off[s + 1] = sym_off[s] + (r.u16() % 600);
    std::vector<int32_t> tids((size_t)n_streams * period);
    for (auto& t : tids) t = (int32_t)(r.u8() % n_tables);
    std::vector<uint32_t> freqs = make_freqs(r, n_tables, alphabet);
    std::vector<uint32_t> info((size_t)n_tables * alphabet);
    std::vector<uint8_t> lut((size_t)n_tables << lut_bits);
    if (cg_build_tables(freqs.data(), n_tables, alphabet, lut_bits, info.data(), lut.data()) != 0) abort();

    const int64_t n_sym = sym_off[n_streams];
    std::vector<uint8_t> payload;
    std::vector<int64_t> in_off(n_streams + 1, 0);
    std::vector<uint8_t> symbols;
    if (mode == 0) {  // the rest of the input, cut into substreams by lengths taken from the input
        std::vector<uint32_t> lens(n_streams);
        for (auto& l : lens) l = r.u16() % 2048;
        payload.assign(r.p, r.p + r.n);
        int64_t pos = 0;
        for (int s = 0; s < n_streams; ++s) {
            pos = pos + lens[s] <= (int64_t)payload.size() ? pos + lens[s] : (int64_t)payload.size();
            in_off[s + 1] = pos;
        }
        in_off[n_streams] = (int64_t)payload.size();
    } else {  // round trip of symbols taken from the input
        symbols.resize(n_sym);
        for (int64_t i = 0; i < n_sym; ++i) symbols[i] = (uint8_t)(r.u8() % alphabet);
        std::vector<int64_t> cap(n_streams + 1, 0);
        for (int s = 0; s < n_streams; ++s) cap[s + 1] = cap[s] + cg_encode_bound(sym_off[s + 1] - sym_off[s]);
        std::vector<uint8_t> out(cap[n_streams] + 1);
        std::vector<int64_t> sizes(n_streams);
        if (cg_encode(symbols.data(), sym_off.data(), n_streams, tids.data(), period, info.data(), n_tables, alphabet,
                      out.data(), cap.data(), sizes.data(), threads) != 0)
            abort();
        for (int s = 0; s < n_streams; ++s) {
            payload.insert(payload.end(), out.begin() + cap[s], out.begin() + cap[s] + sizes[s]);
            in_off[s + 1] = (int64_t)payload.size();
        }
    }
    // Exact-size heap copies, so that ASan sees any read or write past the end.
    uint8_t* in = (uint8_t*)malloc(payload.size() ? payload.size() : 1);
    if (!payload.empty()) memcpy(in, payload.data(), payload.size());
    uint8_t* dec = (uint8_t*)malloc(n_sym ? n_sym : 1);
    std::vector<int32_t> status(n_streams, 0);
    int err = cg_decode(in, in_off.data(), n_streams, sym_off.data(), tids.data(), period, info.data(), lut.data(),
                        lut_bits, n_tables, alphabet, dec, status.data(), threads);
    if (err == 0) {
        for (int64_t i = 0; i < n_sym; ++i)
            if (dec[i] >= alphabet) abort();  // a symbol outside the alphabet was accepted
        if (mode == 1 && n_sym && memcmp(dec, symbols.data(), (size_t)n_sym) != 0) abort();  // mis-decoded
    } else if (mode == 1) {
        abort();  // valid payloads rejected
    }
    free(in);
    free(dec);
    return 0;
}
