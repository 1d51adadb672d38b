// webchat.engine.suffix.SuffixIndex in C++: the same bigram occurrences, the same paths, share for share (the Python
// class is the reference, tests/test_adaptive.py checks the two agree call for call). The auto planner looks a
// decoding stream's context up in two indexes every step it offers a draft; in Python a lookup costs 9-13 us and an
// add 440 ns a token, here 2-6 us and 117 ns (docs/perf-history.md, issue 43's fourteenth try).
//
// What differs from the Python class: a doc's tokens are copied in as they are added (the Python class keeps the
// caller's list and reads past what it indexed; the planner adds a context right before it looks it up, so the two
// read the same tokens), and tokens must be below 2**32 (they share a 64-bit key with the token before).
#include "qsuffix.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

namespace wq {
namespace {

constexpr int POSITION_BITS = 32;
constexpr uint64_t POSITION_MASK = (uint64_t{1} << POSITION_BITS) - 1;

int64_t item(PyObject* list, Py_ssize_t i) {  // list[i] as an int (the caller checked i and the type)
  return PyLong_AsLongLong(PyList_GET_ITEM(list, i));
}

struct Found {  // an occurrence: its match length, its doc's tokens, the position after the match
  int64_t match;
  const std::vector<int64_t>* tokens;
  int64_t pos;
};

class SuffixIndex {
 public:
  SuffixIndex(int64_t max_tokens, int64_t max_occurrences, int64_t max_match, double min_share, int64_t spec_offset,
              py::object path)
      : max_tokens_(max_tokens), max_occurrences_(max_occurrences), max_match_(max_match), min_share_(min_share),
        spec_offset_(spec_offset), path_(std::move(path)) {}

  int64_t new_doc() { return ++next_; }

  void add(int64_t doc, const py::list& tokens) {
    auto it = docs_.find(doc);
    if (it == docs_.end()) {
      it = docs_.emplace(doc, std::vector<int64_t>()).first;
      order_.push_back(doc);
    }
    std::vector<int64_t>& v = it->second;
    const int64_t done = static_cast<int64_t>(v.size()), end = static_cast<int64_t>(py::len(tokens));
    for (int64_t j = done; j < end; ++j) {
      const int64_t t = item(tokens.ptr(), j);
      TORCH_CHECK(t >= 0 && static_cast<uint64_t>(t) <= POSITION_MASK, "token ", t, " at ", j, " of doc ", doc,
                  " is not in [0, 2**32)");
      v.push_back(t);
    }
    const uint64_t high = static_cast<uint64_t>(doc) << POSITION_BITS;
    for (int64_t j = std::max<int64_t>(done, 2); j < end; ++j)  // the bigram ending at j - 1, continued at j
      push(key(v[j - 2], v[j - 1]), high | static_cast<uint64_t>(j));
    size_ += std::max<int64_t>(0, end - done);
    if (max_tokens_) bound();
  }

  py::list paths(const py::list& context, int64_t limit, const py::object& exclude) {
    py::list out;
    const int64_t n = static_cast<int64_t>(py::len(context));
    if (n < 2 || limit < 1) return out;
    // the context's last max_match + 1 tokens, newest last (a match reaches back at most max_match)
    const int64_t keep = std::min(n, max_match_ + 1);
    std::vector<int64_t> tail(keep);
    for (int64_t i = 0; i < keep; ++i) tail[i] = item(context.ptr(), n - keep + i);
    auto at_end = [&](int64_t back) { return tail[keep - 1 - back]; };  // context[n - 1 - back]
    const bool excluding = !exclude.is_none();
    const int64_t skip = excluding ? exclude.cast<int64_t>() : 0;
    std::vector<Found> found;  // newest first
    int32_t o = newest(key(at_end(1), at_end(0)));
    for (int64_t seen = 0; o >= 0 && seen < max_occurrences_; ++seen, o = occ_[o].older) {  // dropped docs' count too
      const int64_t doc = static_cast<int64_t>(occ_[o].code >> POSITION_BITS);
      const int64_t pos = static_cast<int64_t>(occ_[o].code & POSITION_MASK);
      if (excluding && doc == skip) continue;
      auto d = docs_.find(doc);
      if (d == docs_.end() || pos >= static_cast<int64_t>(d->second.size())) continue;
      const std::vector<int64_t>& tokens = d->second;
      int64_t m = 2;
      const int64_t top = std::min({max_match_, pos, n});
      while (m < top && tokens[pos - 1 - m] == at_end(m)) ++m;
      found.push_back({m, &tokens, pos});
    }
    if (found.empty()) return out;
    int64_t longest = 0, shortest = INT64_MAX;
    for (const Found& f : found) longest = std::max(longest, f.match), shortest = std::min(shortest, f.match);
    std::vector<Found> best;
    for (const Found& f : found)
      if (f.match == longest) best.push_back(f);
    follow(best, longest, std::min(limit, longest + spec_offset_), out);
    if (best.size() < found.size()) follow(found, shortest, std::min(limit, shortest + spec_offset_), out);
    return out;
  }

  int64_t size() const { return size_; }
  int64_t dead() const { return dead_; }
  std::vector<int64_t> docs() const { return {order_.begin(), order_.end()}; }

 private:
  static uint64_t key(int64_t a, int64_t b) {
    return static_cast<uint64_t>(a) << POSITION_BITS | static_cast<uint64_t>(b);
  }

  void bound() {
    while (size_ > max_tokens_ && docs_.size() > 1) {
      const int64_t doc = order_.front();
      order_.pop_front();
      auto d = docs_.find(doc);
      const int64_t n = static_cast<int64_t>(d->second.size());
      docs_.erase(d);
      size_ -= n;
      dead_ += n;
    }
    if (dead_ > size_) compact();
  }

  void compact() {  // drop the occurrences of dropped docs: the live ones chained again, oldest first
    std::vector<Occ> all;
    all.swap(occ_);
    std::fill(slots_.begin(), slots_.end(), Slot{0, -1});
    used_ = 0;
    for (const Occ& x : all)
      if (docs_.count(static_cast<int64_t>(x.code >> POSITION_BITS))) push(x.bigram, x.code);
    dead_ = 0;
  }

  // the occurrences: one array, each linked to the one before it of the same bigram; a table (open addressing,
  // linear probing) from a bigram to its newest occurrence
  struct Occ {
    uint64_t bigram, code;  // code: doc << 32 | the position after the bigram
    int32_t older;          // the bigram's occurrence before this one, -1: none
  };
  struct Slot {
    uint64_t bigram;
    int32_t newest;  // -1: an empty slot
  };

  static size_t hash(uint64_t k) {  // a 64-bit mix (splitmix64's finalizer)
    k ^= k >> 30, k *= 0xbf58476d1ce4e5b9ULL, k ^= k >> 27, k *= 0x94d049bb133111ebULL, k ^= k >> 31;
    return static_cast<size_t>(k);
  }

  Slot& slot(uint64_t bigram) {  // its slot, or the empty one where it would go
    size_t i = hash(bigram) & (slots_.size() - 1);
    while (slots_[i].newest >= 0 && slots_[i].bigram != bigram) i = (i + 1) & (slots_.size() - 1);
    return slots_[i];
  }

  int32_t newest(uint64_t bigram) { return slots_.empty() ? -1 : slot(bigram).newest; }

  void push(uint64_t bigram, uint64_t code) {
    TORCH_CHECK(occ_.size() < INT32_MAX, "the suffix index holds 2**31 occurrences");
    if (2 * (used_ + 1) > slots_.size()) grow();
    Slot& s = slot(bigram);
    if (s.newest < 0) s.bigram = bigram, ++used_;
    occ_.push_back({bigram, code, s.newest});
    s.newest = static_cast<int32_t>(occ_.size() - 1);
  }

  void grow() {
    std::vector<Slot> old(std::max<size_t>(1024, 2 * slots_.size()), Slot{0, -1});
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.newest >= 0) slot(s.bigram) = s;
  }

  // suffix.follow: the continuation most of `found` share, token by token, while at least min_share of them agree
  // (ties go to the newest occurrence, first in `found`); appended to out as a Path when it has a token
  void follow(const std::vector<Found>& found, int64_t match, int64_t limit, py::list& out) const {
    std::vector<int64_t> tokens;
    std::vector<double> shares;
    if (found.size() == 1) {  // one occurrence: its text as it goes on
      const std::vector<int64_t>& t = *found[0].tokens;
      const int64_t pos = found[0].pos, end = std::min<int64_t>(static_cast<int64_t>(t.size()), pos + limit);
      tokens.assign(t.begin() + std::min<int64_t>(pos, end), t.begin() + end);
      shares.assign(tokens.size(), 1.0);
    } else {
      std::vector<Found> live = found, kept;
      std::vector<int64_t> nexts, seen;
      std::vector<int64_t> counts;
      double share = 1.0;
      for (int64_t i = 0; i < limit; ++i) {
        nexts.clear();
        for (const Found& f : live)  // -1: that one has ended
          nexts.push_back(f.pos + i < static_cast<int64_t>(f.tokens->size()) ? (*f.tokens)[f.pos + i] : -1);
        // the most common next token, ties to the first seen (the newest): Python's max over a dict in insertion order
        seen.clear();
        counts.clear();
        for (int64_t t : nexts) {
          if (t < 0) continue;
          auto s = std::find(seen.begin(), seen.end(), t);
          if (s == seen.end()) {
            seen.push_back(t);
            counts.push_back(1);
          } else {
            ++counts[s - seen.begin()];
          }
        }
        if (seen.empty()) break;
        size_t top = 0;
        for (size_t k = 1; k < seen.size(); ++k)
          if (counts[k] > counts[top]) top = k;
        const int64_t token = seen[top], agree = counts[top];
        share *= static_cast<double>(agree) / static_cast<double>(live.size());
        if (share < min_share_) break;
        tokens.push_back(token);
        shares.push_back(share);
        if (agree < static_cast<int64_t>(live.size())) {
          kept.clear();
          for (size_t k = 0; k < live.size(); ++k)
            if (nexts[k] == token) kept.push_back(live[k]);
          live.swap(kept);
        }
      }
    }
    if (!tokens.empty()) out.append(path_(match, py::cast(tokens), py::cast(shares), found[0].pos));
  }

  int64_t max_tokens_, max_occurrences_, max_match_;
  double min_share_;
  int64_t spec_offset_;
  py::object path_;  // suffix.Path
  std::unordered_map<int64_t, std::vector<int64_t>> docs_;
  std::deque<int64_t> order_;  // the docs kept, oldest first
  std::vector<Occ> occ_;
  std::vector<Slot> slots_;
  size_t used_ = 0;  // slots holding a bigram
  int64_t size_ = 0, dead_ = 0, next_ = 0;
};

}  // namespace

void bind_suffix(py::module_& m) {
  py::class_<SuffixIndex>(m, "SuffixIndex")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t, py::object>(), py::arg("max_tokens"),
           py::arg("max_occurrences"), py::arg("max_match"), py::arg("min_share"), py::arg("spec_offset"),
           py::arg("path"))
      .def("new_doc", &SuffixIndex::new_doc)
      .def("add", &SuffixIndex::add, py::arg("doc"), py::arg("tokens"))
      .def("paths", &SuffixIndex::paths, py::arg("context"), py::arg("limit"), py::arg("exclude") = py::none())
      .def_property_readonly("size", &SuffixIndex::size)
      .def_property_readonly("dead", &SuffixIndex::dead)
      .def_property_readonly("docs", &SuffixIndex::docs);
}

}  // namespace wq
