/* One thread's packed matrix product, timed: tensor_rows over a random
   packed matrix (a measurement, not a test). Thread CPU time, best of 7,
   so that other work on a shared machine lowers it less; GOP/s against
   the set's --probe int8 peak and
   a 16-chain vpdpbusd peak (two a cycle on both vector ports), both
   measured in the same process (the latter only where the CPU has AVX-512
   VNNI). The set: the best this CPU runs, or SET.
   Build: cc -O3 -march=native -I. tests/bench_kernels.c tokenizer.c -lm -o bench_kernels
   Run:   ./bench_kernels TYPE ROWS COLS TOKENS [SET], e.g. q4_k 8960 1536 72 */
#define main run_main
#include "../run.c"
#undef main
#include <immintrin.h>
static double cpu_now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint64_t rng = 88172645463325252ull;
__attribute__((target("avx512f,avx512vnni"))) static double true_peak(void){
  __m512i a[16]; __m512i x=_mm512_set1_epi8(3),y=_mm512_set1_epi8(-2);
  for(int j=0;j<16;j++) a[j]=_mm512_set1_epi32(j);
  long n=20000000; double t=cpu_now();
  for(long i=0;i<n/16;i++) for(int j=0;j<16;j++) a[j]=_mm512_dpbusd_epi32(a[j],x,y);
  double e=cpu_now()-t; unsigned s=0; for(int j=0;j<16;j++) s+=_mm_cvtsi128_si32(_mm512_castsi512_si128(a[j]));
  if(s==1) puts("");
  return n*128.0/e;
}
static void fill(uint8_t *g, int type, int rows, int cols){
  const PackForm *f=&TYPES[type].pack; size_t gb=packed_group_bytes(f,cols), rb=packed_record_bytes(f);
  for(size_t b=0;b<gb*(rows/PACK_ROWS);b++) g[b]=random_u32(&rng);
  int halves = f->kind==PACK_K6?1:1+(f->kind==PACK_K4||f->has_min);
  for(int grp=0;grp<rows/PACK_ROWS;grp++) for(int k=0;k<cols/packed_block(f);k++){
    uint8_t *rec=g+grp*gb+k*rb; 
    for(int p=0;p<halves;p++) for(int r=0;r<PACK_ROWS;r++){ uint16_t h=0x2000+(random_u32(&rng)&0x3ff); memcpy(rec+2*(p*PACK_ROWS+r),&h,2);} }
}
int main(int argc, char **argv){
  int set = best_kernel_set();
  const char *tname = argc>1?argv[1]:"q4_k"; int rows = argc>2?atoi(argv[2]):8960, cols=argc>3?atoi(argv[3]):1536, ntok=argc>4?atoi(argv[4]):72;
  if(argc>5) for(int s=0;s<N_KSETS;s++) if(SETS[s]&&!strcmp(SETS[s]->op.name,argv[5])) set=s;
  select_kernels(set);
  int type=-1; for(int t=0;t<N_TYPES;t++) if(TYPES[t].name&&!strcmp(TYPES[t].name,tname)) type=t;
  const PackForm *f=&TYPES[type].pack; int act=TYPES[type].act;
  size_t gb=packed_group_bytes(f,cols); uint8_t *w=aligned_alloc(64, gb*(rows/PACK_ROWS)); fill(w,type,rows,cols);
  size_t xs=act_bytes(act,cols); uint8_t *xq=malloc(xs*ntok); float *xf=malloc(sizeof(float)*cols);
  for(int t=0;t<ntok;t++){ for(int i=0;i<cols;i++) xf[i]=random_f32(&rng)*2-1; if(act!=ACT_F32) quantize_act(act,xq+t*xs,xf,cols); else memcpy(xq+t*xs,xf,xs);}
  float *out=malloc(sizeof(float)*rows*ntok);
  Tensor T={"w",type,rows,cols,LAYOUT_PACKED,w};
  double best=1e9; unsigned sink=0;
  double pk=__builtin_cpu_supports("avx512vnni")?true_peak():0; double t0=cpu_now(); double probe=K.op.peak_i8(&sink)/(cpu_now()-t0);
  int reps = (int)(2e9/(2.0*rows*cols*ntok))+1; if(reps>200)reps=200;
  for(int it=0;it<7;it++){ double t=cpu_now(); for(int r=0;r<reps;r++) tensor_rows((Out){out,rows,0},&T,(Act){xq,xs},ntok,0,rows); double e=(cpu_now()-t)/reps; if(e<best)best=e; }
  double gops=2.0*rows*cols*ntok/best;
  char vnni[64] = "";
  if (pk > 0) snprintf(vnni, sizeof vnni, "  %5.1f%% of 16-chain peak (%.0f)", 100*gops/pk, pk/1e9);
  printf("%-5s %-7s %5dx%-5d tok %3d: %7.3f ms  %6.1f GOP/s  %5.1f%% of probe peak (%.0f)%s  checksum %.4g\n",
     SETS[set]->op.name, tname, rows, cols, ntok, best*1e3, gops/1e9, 100*gops/probe, probe/1e9, vnni, out[0]+out[rows*ntok-1]);
  return 0;
}
