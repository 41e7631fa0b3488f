// ferry::Shape: the dims (or strides, or a multi-index) of a tensor, a vector of int64_t
// that keeps up to four elements inline.
//
// Why not std::vector: a routing table at scale holds millions of layouts (fsdp=4096 ->
// tp=8 over an 8B model: 4.7 million pack ops and as many unpack ops, each with a shape
// and strides), and a std::vector of one or two dims is a heap block of its own (kept
// inline, that plan went from 12.6 to 10.3 s and 2.32 to 2.15 GB, docs/RESULTS.md).
// Tensors have few dims; more than four spill to the heap as a std::vector would.
//
// The interface is std::vector's for a sequence (same names and semantics; no
// allocator, iterators are pointers, a moved-from Shape is empty); converts implicitly
// from std::vector<int64_t> and to it with vec(). Not thread-safe (a value type).
#pragma once

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace ferry {

// The most elements a tensor's shape may span, counting a size of 0 as 1 (so that the
// contiguous strides of any shape a tensor holds fit int64): Tensor::empty and
// Tensor::borrow refuse a shape past it, and so does the safetensors reader.
inline constexpr int64_t kMaxShapeElements = int64_t{1} << 56;

class Shape {
 public:
  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;
  static constexpr size_t kInline = 4;

  Shape() noexcept {}
  explicit Shape(size_t n, int64_t value = 0) { assign(n, value); }
  Shape(std::initializer_list<int64_t> il) { assign(il.begin(), il.end()); }
  template <typename It, typename = std::enable_if_t<!std::is_integral_v<It>>>
  Shape(It first, It last) {
    assign(first, last);
  }
  Shape(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }  // NOLINT: implicit by design
  Shape(const Shape& o) { assign(o.begin(), o.end()); }
  Shape(Shape&& o) noexcept { steal(o); }
  ~Shape() { release(); }

  Shape& operator=(const Shape& o) {
    if (this != &o) assign(o.begin(), o.end());
    return *this;
  }
  Shape& operator=(Shape&& o) noexcept {
    if (this != &o) {
      release();
      steal(o);
    }
    return *this;
  }
  Shape& operator=(std::initializer_list<int64_t> il) {
    assign(il.begin(), il.end());
    return *this;
  }

  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  size_t capacity() const noexcept { return cap_; }
  int64_t* data() noexcept { return cap_ > kInline ? heap_ : inline_; }
  const int64_t* data() const noexcept { return cap_ > kInline ? heap_ : inline_; }

  iterator begin() noexcept { return data(); }
  iterator end() noexcept { return data() + size_; }
  const_iterator begin() const noexcept { return data(); }
  const_iterator end() const noexcept { return data() + size_; }
  const_iterator cbegin() const noexcept { return begin(); }
  const_iterator cend() const noexcept { return end(); }
  reverse_iterator rbegin() noexcept { return reverse_iterator(end()); }
  reverse_iterator rend() noexcept { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const noexcept { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const noexcept { return const_reverse_iterator(begin()); }

  int64_t& operator[](size_t i) noexcept { return data()[i]; }
  const int64_t& operator[](size_t i) const noexcept { return data()[i]; }
  int64_t& at(size_t i) {
    if (i >= size_) throw std::out_of_range("ferry::Shape::at");
    return data()[i];
  }
  const int64_t& at(size_t i) const {
    if (i >= size_) throw std::out_of_range("ferry::Shape::at");
    return data()[i];
  }
  int64_t& front() noexcept { return data()[0]; }
  const int64_t& front() const noexcept { return data()[0]; }
  int64_t& back() noexcept { return data()[size_ - 1]; }
  const int64_t& back() const noexcept { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n > cap_) grow_to(n);
  }
  void shrink_to_fit() noexcept {}
  void clear() noexcept { size_ = 0; }
  void push_back(int64_t x) {
    if (size_ == cap_) grow_to(cap_ * 2);
    data()[size_++] = x;
  }
  int64_t& emplace_back(int64_t x) {
    push_back(x);
    return back();
  }
  void pop_back() noexcept { --size_; }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    if (n > size_) std::fill(data() + size_, data() + n, value);
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, int64_t value) {
    size_ = 0;
    reserve(n);
    std::fill(data(), data() + n, value);
    size_ = static_cast<uint32_t>(n);
  }
  template <typename It, typename = std::enable_if_t<!std::is_integral_v<It>>>
  void assign(It first, It last) {
    // (May alias this shape's own elements: copied out before anything is touched.)
    if constexpr (std::is_same_v<std::decay_t<It>, const int64_t*> || std::is_same_v<std::decay_t<It>, int64_t*>) {
      if (first >= begin() && first <= end()) {
        Shape copy;
        copy.append(first, last);
        *this = std::move(copy);
        return;
      }
    }
    size_ = 0;
    append(first, last);
  }
  void assign(std::initializer_list<int64_t> il) { assign(il.begin(), il.end()); }

  iterator insert(const_iterator pos, int64_t x) { return insert(pos, size_t{1}, x); }
  iterator insert(const_iterator pos, size_t n, int64_t x) {
    const size_t at = index_of(pos);
    make_gap(at, n);
    std::fill(data() + at, data() + at + n, x);
    return data() + at;
  }
  template <typename It, typename = std::enable_if_t<!std::is_integral_v<It>>>
  iterator insert(const_iterator pos, It first, It last) {
    const size_t at = index_of(pos);
    const Shape src(first, last);  // (the range may be this shape's own)
    make_gap(at, src.size());
    std::copy(src.begin(), src.end(), data() + at);
    return data() + at;
  }
  iterator insert(const_iterator pos, std::initializer_list<int64_t> il) { return insert(pos, il.begin(), il.end()); }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const size_t a = index_of(first), b = index_of(last);
    std::copy(data() + b, data() + size_, data() + a);
    size_ -= static_cast<uint32_t>(b - a);
    return data() + a;
  }
  void swap(Shape& o) noexcept {
    Shape t(std::move(o));
    o = std::move(*this);
    *this = std::move(t);
  }

  friend bool operator==(const Shape& a, const Shape& b) noexcept {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend std::strong_ordering operator<=>(const Shape& a, const Shape& b) noexcept {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const Shape& a, const std::vector<int64_t>& b) noexcept {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  size_t index_of(const_iterator p) const noexcept { return static_cast<size_t>(p - begin()); }
  template <typename It>
  void append(It first, It last) {
    if constexpr (std::is_base_of_v<std::forward_iterator_tag, typename std::iterator_traits<It>::iterator_category>) {
      reserve(size_ + static_cast<size_t>(std::distance(first, last)));
    }
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }
  void make_gap(size_t at, size_t n) {
    reserve(size_ + n);
    int64_t* d = data();
    std::copy_backward(d + at, d + size_, d + size_ + n);
    size_ += static_cast<uint32_t>(n);
  }
  void grow_to(size_t n) {
    n = std::max<size_t>(n, kInline * 2);
    auto* fresh = new int64_t[n];
    std::copy(begin(), end(), fresh);
    release();
    heap_ = fresh;
    cap_ = static_cast<uint32_t>(n);
  }
  void release() noexcept {
    if (cap_ > kInline) delete[] heap_;
    cap_ = kInline;
  }
  void steal(Shape& o) noexcept {
    size_ = o.size_;
    cap_ = o.cap_;
    if (o.cap_ > kInline) {
      heap_ = o.heap_;
    } else {
      std::copy(o.inline_, o.inline_ + o.size_, inline_);
    }
    o.size_ = 0;
    o.cap_ = kInline;
  }

  uint32_t size_ = 0;
  uint32_t cap_ = kInline;
  union {
    int64_t inline_[kInline];
    int64_t* heap_;
  };
};

inline void swap(Shape& a, Shape& b) noexcept { a.swap(b); }

}  // namespace ferry
